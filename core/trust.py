"""Who else can steer a run: the one check of who owns and can write a path (a run directory, its
config.yaml and jobs/, a task_path), and the checked loader of config.yaml for the processes that
act on it (the merge service checks the whole run first; each worker job through load_run_config),
since config.yaml names the code they import (task_path) and the shell lines they run
(executor.setup): whoever can rewrite it runs commands as the run's owner.
"""
from __future__ import annotations

import os
import stat

from core.config import Config, config_from_dict
from core.config_parse import load_yaml
from core.errors import RunError
from core.layout import RunLayout
from core.storage import Storage

L = RunLayout()
CONFIG_LIMIT = 4 << 20  # bytes of a config.yaml: a resolved config is a few KB


def stranger(st: os.stat_result, *, allow_group: bool = False) -> str | None:
    """Who else can change a file or folder of this `st`: "belongs to uid N, not you (uid M)", "is
    writable by other users (0o...)" (or "your group", unless `allow_group`); None: only you."""
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid != os.getuid():
        return f"belongs to uid {st.st_uid}, not you (uid {os.getuid()})"
    if mode & 0o002 or (mode & 0o020 and not allow_group):
        return f"is writable by {'other users' if mode & 0o002 else 'your group'} ({oct(mode)})"
    return None


def unsafe_paths(storage: Storage, keys: tuple[str, ...], *, allow_group: bool = False) -> list[str]:
    """Each of `keys` (files or folders of a local run; "" is the run itself) that someone else could
    change, with the command that fixes it. Object stores have no such modes (their access is the
    bucket's policy): nothing is checked there."""
    if storage.local_path("") is None:
        return []
    loose = []
    for key in keys:
        path = storage.local_path(key)
        try:
            st = os.lstat(path)
        except (FileNotFoundError, NotADirectoryError):  # absent, or under a file: nothing there to change
            continue
        who = stranger(st, allow_group=allow_group)
        if who is None:
            continue
        fix = "go-w" if not allow_group else "o-w"
        loose.append(f"{path} {who}: " + ("use a run directory of your own" if who.startswith("belongs") else
                                          f"chmod {'-R ' if stat.S_ISDIR(st.st_mode) else ''}{fix} {path}"))
    return loose


def load_run_config(storage: Storage) -> Config:
    """The run's config.yaml, parsed and checked, once the run and the file are known to be the
    user's and writable by no other user (a group-writable run was consented to when the service
    started it: --allow-group-write). RunError naming what is loose, and the fix."""
    loose = unsafe_paths(storage, ("", L.CONFIG), allow_group=True)
    if loose:
        raise RunError("others can rewrite this run's config (which names the code every job imports and the "
                       "commands it runs):\n  " + "\n  ".join(loose) + "\nfix the modes above; nothing was run")
    return read_run_config(storage)


def read_run_config(storage: Storage) -> Config:
    """The run's config.yaml, parsed and checked as a config (what `status` and `report` read: no
    code runs from it there)."""
    if not storage.exists(L.CONFIG):
        raise RunError(f"{storage.display()} is not a run directory (no {L.CONFIG})")
    return config_from_dict(load_yaml(storage.read_bytes(L.CONFIG, limit=CONFIG_LIMIT), storage.display(L.CONFIG)),
                            source=storage.display(L.CONFIG))
