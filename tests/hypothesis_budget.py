"""How many examples a property test runs: the count each test names is CI's budget (it keeps
`bash .ci/run` within its time); `RADIXLM_HYPOTHESIS=thorough` multiplies every count by ten, for a
change to a data structure, a kernel or a parser (`RADIXLM_HYPOTHESIS=thorough bash scripts/test.sh`)."""

from __future__ import annotations

import os

PROFILES = {"ci": 1, "thorough": 10}
_profile = os.environ.get("RADIXLM_HYPOTHESIS", "ci")
if _profile not in PROFILES:
    raise ValueError(f"RADIXLM_HYPOTHESIS must be one of {sorted(PROFILES)}, got {_profile!r}")


def examples(ci: int) -> int:
    """`ci` examples in CI, ten times as many in the thorough profile."""
    return ci * PROFILES[_profile]
