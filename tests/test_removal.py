"""`remove_tree`: a folder, a file or a link goes; what cannot be deleted is returned, never hidden."""

import os

from beamrl.removal import remove_tree, undeleted_line


def test_folders_files_and_links_are_removed(tmp_path):
    (tmp_path / "d" / "e").mkdir(parents=True)
    (tmp_path / "d" / "e" / "f").write_text("x")
    (tmp_path / "file").write_text("x")
    os.symlink(tmp_path / "d", tmp_path / "link")
    assert remove_tree(tmp_path / "link") == [] and (tmp_path / "d" / "e" / "f").exists()  # the link, not its target
    assert remove_tree(tmp_path / "d") == [] and remove_tree(tmp_path / "file") == []
    assert remove_tree(tmp_path / "never-there") == []
    assert sorted(os.listdir(tmp_path)) == []


def test_what_cannot_be_deleted_is_returned_and_said_in_one_line(tmp_path, monkeypatch):
    import shutil

    def refusing(path, onexc=None, onerror=None):
        for name in ("a", "b"):
            error = PermissionError(13, "Permission denied", os.path.join(path, name))
            onexc(os.unlink, error.filename, error) if onexc else onerror(os.unlink, error.filename, (None, error, None))

    (tmp_path / "d").mkdir()
    monkeypatch.setattr(shutil, "rmtree", refusing)
    errors = remove_tree(tmp_path / "d")
    assert [os.path.basename(t) for t, _ in errors] == ["a", "b"]
    assert undeleted_line(tmp_path / "d", errors).endswith("Permission denied: '" + str(tmp_path / "d" / "a")
                                                           + "' (and 1 more files or folders)")
