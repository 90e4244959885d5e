"""`specd pull MODEL`: download a checkpoint from the Hugging Face hub into its cache
(progress bars and resuming come from huggingface_hub.snapshot_download)."""

from __future__ import annotations

import argparse

# What specd reads from a checkpoint; everything else (other formats, images) is skipped.
CHECKPOINT_FILES = [
    "*.json",
    "*.safetensors",
    "tokenizer.model",
    "*.jinja",
]


class PullError(RuntimeError):
    """The hub download failed (network, access, or an unknown repository)."""


def cmd_pull(args: argparse.Namespace) -> int:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError

    try:
        path = snapshot_download(
            repo_id=args.model,
            revision=args.revision,
            allow_patterns=CHECKPOINT_FILES,
        )
    except RepositoryNotFoundError:
        raise PullError(
            f"{args.model!r} was not found on the hub (or it is gated: run "
            "`hf auth login` with an account that has access)"
        ) from None
    except (HfHubHTTPError, OSError) as exc:
        raise PullError(f"downloading {args.model!r} failed: {exc}; run again to resume") from None
    print(f"{args.model} is in {path}\nuse it with: specd serve --model {args.model}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    pull = sub.add_parser("pull", help="download a model from the Hugging Face hub (resumable)")
    pull.add_argument("model", help="hub id, e.g. meta-llama/Llama-3.2-1B-Instruct")
    pull.add_argument("--revision", default=None, help="branch, tag or commit")
    pull.set_defaults(func=cmd_pull)
