"""A subprocess started now and awaited later: the kill/resume tests start their uninterrupted reference run beside
their first killed run (one thread each, so the two use both cores)."""

import subprocess
from pathlib import Path


def run_in_background(command: list[str], env: dict, folder: Path):
    """For a module fixture: `yield from` it. Starts `command` (stderr to `folder`/stderr.txt) and yields a function
    that waits for it, asserts exit 0 and returns `folder`; kills it at teardown if it still runs."""
    with open(folder / "stderr.txt", "w") as err:
        proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=err)

    def finished() -> Path:
        assert proc.wait(timeout=300) == 0, (folder / "stderr.txt").read_text()[-2000:]
        return folder

    yield finished
    if proc.poll() is None:
        proc.kill()
        proc.wait()
