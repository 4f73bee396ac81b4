"""`python -m ep_plugin ...` is the `ep-plugin` command."""
import sys

from .cli import main

sys.exit(main())
