"""Release numbers of the frameworks the integrations patch (megatron-core, vLLM)."""
from __future__ import annotations

import re
from typing import Optional, Tuple


def parse_release(text: str) -> Optional[Tuple[int, int, int]]:
    """'0.19.2+f6a5b40' -> (0, 19, 2); pre-releases keep their numeric part ('0.20.0rc1' -> (0, 20, 0));
    None where `text` does not start with a release number."""
    match = re.match(r"^\s*(\d+)\.(\d+)(?:\.(\d+))?", text)
    return (int(match.group(1)), int(match.group(2)), int(match.group(3) or 0)) if match else None
