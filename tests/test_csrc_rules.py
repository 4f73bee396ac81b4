"""Rules for csrc/ that a compiler does not enforce."""
import re
from pathlib import Path

CSRC = Path(__file__).resolve().parent.parent / "csrc"
IOSTREAMS = re.compile(r"#include\s*<(sstream|iostream|ostream|fstream)>|std::(o|i)?stringstream|std::c(out|err)\b")


def test_no_iostreams_in_csrc():
    """Messages are built with ep_plugin::Text (csrc/common/text.h). iostreams crashed on the GPU
    machine, whose toolchain puts a second libstdc++ copy in the extension (its locale facets mix
    with the process's), so every error message segfaulted instead of raising."""
    offenders = [f"{path.relative_to(CSRC)}:{number}: {line.strip()}"
                 for path in sorted(CSRC.rglob("*")) if path.suffix in (".cu", ".cuh", ".cpp", ".h")
                 for number, line in enumerate(path.read_text().splitlines(), 1)
                 if IOSTREAMS.search(line) and not line.lstrip().startswith("//")]
    assert not offenders, "use ep_plugin::Text instead:\n" + "\n".join(offenders)


def test_error_messages_carry_their_numbers():
    """ep_plugin::Text formats integers and doubles into the ValueError (checked before any CUDA call)."""
    import pytest

    _C = pytest.importorskip("ep_plugin._C", reason="the CUDA extension is not built here")
    with pytest.raises(ValueError, match=r"supports 1 to 8 ranks, got 99$"):
        _C.IntranodeRuntime(0, 99, 1 << 20, 1.0)
    with pytest.raises(ValueError, match=r"rank -3 out of range for 2 ranks"):
        _C.IntranodeRuntime(-3, 2, 1 << 20, 1.0)
    with pytest.raises(ValueError, match=r"at least 1048576 \(got 4096\)"):
        _C.IntranodeRuntime(0, 2, 4096, 1.0)
