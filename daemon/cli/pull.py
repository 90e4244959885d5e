"""`specd pull MODEL`: download a checkpoint from the Hugging Face hub into its cache
(progress bars and resuming come from huggingface_hub.snapshot_download)."""

from __future__ import annotations

import argparse

from modeling.checkpoints.hub_patterns import CHECKPOINT_FILES, CONFIG_FILES, SKIPPED_FILES


class PullError(RuntimeError):
    """The hub download failed (network, access, or an unknown repository)."""


def cmd_pull(args: argparse.Namespace) -> int:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    if constants.HF_HUB_OFFLINE:
        raise PullError(
            f"cannot download {args.model!r}: HF_HUB_OFFLINE is set, so the hub is not "
            "contacted; unset it (or run where the hub is reachable) to pull"
        )
    what = CONFIG_FILES if args.config_only else CHECKPOINT_FILES
    try:
        path = snapshot_download(
            repo_id=args.model,
            revision=args.revision,
            allow_patterns=what,
            ignore_patterns=SKIPPED_FILES,
        )
    except RepositoryNotFoundError:
        raise PullError(
            f"{args.model!r} was not found on the hub (or it is gated: run "
            "`hf auth login` with an account that has access)"
        ) from None
    except LocalEntryNotFoundError:
        # huggingface_hub's answer when it cannot connect and nothing is cached.
        raise PullError(
            f"cannot download {args.model!r}: the hub cannot be reached from here (no "
            "network, a proxy or a firewall); check the connection and run again"
        ) from None
    except (HfHubHTTPError, OSError) as exc:
        raise PullError(
            f"downloading {args.model!r} stopped: {exc}; run again to resume (finished files "
            "are kept)"
        ) from None
    if args.config_only:
        print(f"{args.model}'s config is in {path}\nplan with: specd plan --model {args.model}")
    else:
        print(f"{args.model} is in {path}\nuse it with: specd serve --model {args.model}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    pull = sub.add_parser("pull", help="download a model from the Hugging Face hub (resumable)")
    pull.add_argument("model", help="hub id, e.g. meta-llama/Llama-3.2-1B-Instruct")
    pull.add_argument("--revision", default=None, help="branch, tag or commit")
    pull.add_argument(
        "--config-only",
        action="store_true",
        help="only config.json and generation_config.json: enough for `specd plan`",
    )
    pull.set_defaults(func=cmd_pull)
