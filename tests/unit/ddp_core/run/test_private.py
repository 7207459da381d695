"""The one rule for the folders ddpjob makes outside a run directory (``ddp_core.run.private``), against a real second
user (tests/support/users.py): what ``ddpjob-mallory`` makes first in a shared sticky folder (0777, 0755, a symlink,
a file) is refused in one line naming the path and its owner or mode, and what ``ddpjob-alice`` makes (a temporary
folder, a file written with ``opener``, under umask 000) mallory can neither read nor list."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

from ddp_core.errors import DdpJobError
from ddp_core.run import private
from tests.support import users
from tests.support.users import SYSTEM_PYTHON


@pytest.fixture
def shared():
    users.require_root()
    folder = Path(tempfile.mkdtemp(prefix="ddpjob-test-shared-", dir="/tmp"))
    folder.chmod(0o1777)  # as /tmp and /dev/shm
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.parametrize(
    ("script", "problem"),
    [
        ("mkdir -m 0777 {p}", "is owned by ddpjob-mallory (uid {uid}), not root (uid 0)"),
        ("mkdir -m 0755 {p}", "is owned by ddpjob-mallory (uid {uid}), not root (uid 0)"),
        ("ln -s /root {p}", "is a symlink (to /root)"),
        ("touch {p}", "is not a folder"),
    ],
)
def test_a_place_another_user_made_first_is_refused_naming_its_owner(shared, script, problem):
    mallory = users.ensure("mallory")
    place = shared / private.per_user_name("42")
    users.shell(mallory, script.format(p=place), check=True)
    with pytest.raises(DdpJobError) as err:
        private.folder(place, "the tier's folder")
    assert err.value.message == f"the tier's folder {place} {problem.format(uid=mallory.uid)}: refused"
    assert err.value.hint


def test_a_folder_of_ones_own_with_group_or_other_access_is_refused_naming_its_mode(shared):
    place = shared / "open"
    place.mkdir(mode=0o750)
    place.chmod(0o750)
    with pytest.raises(DdpJobError, match=r"has mode 0750 \(group or others have access; it must be 0700\): refused"):
        private.check(place)
    place.chmod(0o700)
    assert private.folder(place) == place  # made before by this user, private: used


def test_what_alice_makes_is_hers_alone_whatever_her_umask(shared):
    alice, mallory = users.ensure("alice"), users.ensure("mallory")
    code = (
        "from ddp_core.run import private\n"
        f"made = private.temp_folder('stage', __import__('pathlib').Path('{shared}'))\n"
        "with open(made / 'sent.json', 'w', opener=private.opener) as f: f.write('secret')\n"
        "private.makedirs(made / 'tree' / 'a')\n"
        "print(made)\n"
    )
    made = Path(users.run(alice, [SYSTEM_PYTHON, "-c", code], umask=0o000, check=True).stdout.strip())
    assert made.parent == shared and made.name.startswith("ddpjob-ddpjob-alice-stage-")
    assert {p.relative_to(made).as_posix(): oct(p.lstat().st_mode & 0o777) for p in [made, *made.rglob("*")]} == {
        ".": "0o700",
        "sent.json": "0o600",
        "tree": "0o700",
        "tree/a": "0o700",
    }
    for script in (f"cat {made}/sent.json", f"ls {made}", f"touch {made}/tree/planted"):
        proc = users.shell(mallory, script)
        assert proc.returncode != 0 and "Permission denied" in proc.stderr, (script, proc.stderr)
