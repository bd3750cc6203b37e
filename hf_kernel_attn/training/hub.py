"""``push_to_hub: true``: upload the converted model folder (weights, tokenizer, model card) to the Hub."""

from __future__ import annotations

from pathlib import Path


class HubUploadError(RuntimeError):
    """The upload failed; the converted model is saved locally all the same."""


def push_folder(folder: Path, repo_id: str, *, private: bool = False, token: str | None = None) -> str:
    """Create ``repo_id`` (if needed) and upload ``folder`` to it in one commit; the repo's URL.
    Offline, unauthorised or unreachable: :class:`HubUploadError` naming the repo, the cause and the folder."""
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    try:
        url = api.create_repo(repo_id, private=private, exist_ok=True)
        api.upload_folder(repo_id=repo_id, folder_path=str(folder),
                          commit_message=f"hf-kernel-attn: converted model ({folder.name})")
    except Exception as exc:  # offline mode, network, auth: all end the same way, the folder is kept
        raise HubUploadError(
            f"push_to_hub: uploading {str(folder)!r} to the Hub repo {repo_id!r} failed ({type(exc).__name__}: "
            f"{exc}); the converted model is saved there -- upload it later with "
            f"`huggingface-cli upload {repo_id} {folder}`") from exc
    return str(url)
