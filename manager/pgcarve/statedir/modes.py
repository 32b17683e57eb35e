"""Files holding secrets are 0600 (their directories' owner only), checked again at every start.

pgcarve writes them 0600 whatever the umask; a looser mode means someone changed it since, or
copied the file in with `cp` under a permissive umask. A start makes them 0600 again and says so in
words an operator can act on: the mode is fixed, but whoever could read the file meanwhile may
hold the secret.
"""

from __future__ import annotations

import logging
import stat

from pgcarve.settings import Paths
from pgcarve.statedir.layout import kept_files

log = logging.getLogger(__name__)


def tighten_secret_files(paths: Paths) -> list[str]:
    """Make each file of the state directory that holds a secret 0600, and `instances/` 0700, where group
    or others could read or write them; one sentence per change (also logged as a warning)."""
    changed = []
    for kept in kept_files(paths):
        path = paths.state_dir / kept.relative
        mode = stat.S_IMODE(path.stat().st_mode)
        if kept.secret and mode & 0o077:
            path.chmod(0o600)
            changed.append(f"{path} ({kept.what}) could be read by group or others (mode {mode:04o}); it is 0600 "
                           "now. Whoever could read it meanwhile may have copied it: if that matters, change that "
                           "secret")
    directory = paths.instance_secrets_dir
    if directory.is_dir() and stat.S_IMODE(directory.stat().st_mode) & 0o077:
        mode = stat.S_IMODE(directory.stat().st_mode)
        directory.chmod(0o700)
        changed.append(f"{directory} (the instances' passwords) was open to group or others (mode {mode:04o}); it "
                       "is 0700 now")
    for sentence in changed:
        log.warning("%s", sentence)
    return changed
