"""A full disk when a command first writes its folder (issue #40): one line, and the folders it made
go again (train.py's run lock, evaluate.py's config.json)."""

import errno

import evaluate
from evaluation import eval_folder
from plumbing import run_dir


def full_disk(monkeypatch, module):
    """open() for writing in `module` raises ENOSPC, as on a full disk (folders can still be made)."""
    real = open

    def fake(file, mode="r", *a, **k):
        if any(c in mode for c in "wax+"):
            raise OSError(errno.ENOSPC, "No space left on device", str(file))
        return real(file, mode, *a, **k)
    monkeypatch.setattr(module, "open", fake, raising=False)


def test_the_run_lock_on_a_full_disk_is_one_line_and_leaves_no_folder(tmp_path, monkeypatch):
    full_disk(monkeypatch, run_dir)
    out = tmp_path / "a" / "b" / "run"
    lock = run_dir.RunLock(str(out))
    assert lock.acquire() == f"cannot write {out} (No space left on device)"
    assert not (tmp_path / "a").exists() and lock.f is None


def test_evaluate_config_on_a_full_disk_is_one_line_and_leaves_no_folder(tmp_path, monkeypatch):
    full_disk(monkeypatch, eval_folder)
    out = tmp_path / "a" / "eval"
    assert evaluate.write_first(str(out), {"seed": 0}, {}) == f"cannot write {out}/config.json (No space left on device)"
    assert not (tmp_path / "a").exists()
    (tmp_path / "b").mkdir()                                          # a folder that was there stays
    assert evaluate.write_first(str(tmp_path / "b"), {"seed": 0}, {}).startswith("cannot write")
    assert (tmp_path / "b").is_dir() and not list((tmp_path / "b").iterdir())
