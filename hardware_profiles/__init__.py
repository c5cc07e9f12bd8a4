"""Hardware profiles: what one accelerator and its cluster shape can do.

`load_profile("a100-80gb-sxm")` or `load_profile("my.yaml")` is all most code
needs. Importing this package is cheap (PyYAML only). Measuring this machine lives
in the submodule `pipeplan.hardware_profiles.calibrate` (it imports torch), and is
deliberately not re-exported here: a package attribute named like a submodule is
replaced by the module object as soon as the submodule is imported.
"""

from pipeplan.choices import DTYPES
from pipeplan.hardware_profiles.loader import (
    PROFILE_FORMAT,
    list_profiles,
    load_profile,
    profile_to_dict,
    save_profile,
    user_profile_dir,
)
from pipeplan.hardware_profiles.profile import HardwareProfile, Link

__all__ = [
    "DTYPES",
    "PROFILE_FORMAT",
    "HardwareProfile",
    "Link",
    "list_profiles",
    "load_profile",
    "profile_to_dict",
    "save_profile",
    "user_profile_dir",
]
