"""The release check both integrations run before patching their framework (megatron-core, vLLM).

Each integration declares one `SupportedReleases`; `check(version)` accepts a release inside the
range, rejects one outside it (or, with the range's opt-in variable set to 1, warns and lets the
integration's structural checks decide), and rejects a version string it cannot parse.
"""
from __future__ import annotations

import os
import re
import warnings
from dataclasses import dataclass
from typing import Optional, Tuple, Type

Release = Tuple[int, int, int]


class UnsupportedRelease(RuntimeError):
    """The framework is missing, outside the supported range, or its patched objects are not as expected."""


def parse_release(text: str) -> Optional[Release]:
    """'0.19.2+f6a5b40' -> (0, 19, 2); pre-releases keep their numeric part ('0.20.0rc1' -> (0, 20, 0));
    None where `text` does not start with a release number."""
    match = re.match(r"^\s*(\d+)\.(\d+)(?:\.(\d+))?", text)
    return (int(match.group(1)), int(match.group(2)), int(match.group(3) or 0)) if match else None


@dataclass(frozen=True)
class SupportedReleases:
    """An inclusive range of (major, minor) releases of one framework.

    Fields:
        framework: the name users know ("vLLM", "megatron-core").
        minimum, maximum: the first and last supported (major, minor).
        allow_untested_env: variable that, set to 1, turns a release outside the range into a warning.
        error: the exception type raised (a subclass of `UnsupportedRelease`).
    """

    framework: str
    minimum: Tuple[int, int]
    maximum: Tuple[int, int]
    allow_untested_env: str
    error: Type[UnsupportedRelease] = UnsupportedRelease

    def describe(self) -> str:
        """'0.32.x to 0.33.x'."""
        return f"{self.minimum[0]}.{self.minimum[1]}.x to {self.maximum[0]}.{self.maximum[1]}.x"

    def parse(self, text: str) -> Release:
        """The release number of `text`; raises `error` when there is none."""
        release = parse_release(text)
        if release is None:
            raise self.error(f"cannot parse the {self.framework} version {text!r}")
        return release

    def check(self, text: str, surface: str) -> Release:
        """The release of version `text`; raises `error` outside the range unless the opt-in variable is 1.

        `surface` names what the integration patches, for the message."""
        release = self.parse(text)
        if self.minimum <= release[:2] <= self.maximum:
            return release
        message = (f"ep_plugin supports {self.framework} {self.describe()}, found {text}: its patch surface "
                   f"({surface}) has not been checked against this release.")
        if os.environ.get(self.allow_untested_env) != "1":
            raise self.error(f"{message} Set {self.allow_untested_env}=1 to try anyway.")
        warnings.warn(f"{message} Continuing because {self.allow_untested_env}=1.", RuntimeWarning, stacklevel=3)
        return release
