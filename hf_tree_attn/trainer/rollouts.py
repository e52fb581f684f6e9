"""Checks of generated rollouts, before TRL's code reads them.

TRL's GRPO trainer takes `prompt_ids` / `completion_ids` from its generator or a user's `rollout_func` as they come.
Two shapes break it, one loudly and one silently:

- an empty completion: TRL's metrics read `ids[-1]` of every completion (`IndexError`, with no word of which sample);
- an empty prompt: the first completion token has no token before it to be predicted from. TRL's flat forward
  left-pads the prompts, so it scores that token from a padding position (a number, silently wrong); a tree has
  no parent row for it.

Both are refused here, naming the sample and the fix.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

__all__ = ["check_rollouts", "checked_rollout_func"]


def _preview(ids: Sequence[int], decode: Callable | None) -> str:
    text = decode(list(ids)) if decode is not None and len(ids) else str(list(ids)[:16])
    return repr(text if len(text) <= 80 else text[:77] + "...")


def check_rollouts(
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    source: str,
    decode: Callable | None = None,
) -> None:
    """Raise `ValueError` for the first sample with an empty prompt or an empty completion.

    Args:
        prompt_ids: one token-id sequence per sample (a prompt may repeat for each of its completions).
        completion_ids: one token-id sequence per sample.
        source: who produced them, for the message ("rollout_func", "generation").
        decode: token ids -> text, to show the sample's prompt.
    """
    for i, (prompt, completion) in enumerate(zip(prompt_ids, completion_ids)):
        if len(prompt) == 0:
            raise ValueError(
                f"{source} returned an empty prompt for sample {i} (completion {_preview(completion, decode)}): its "
                "first completion token has no earlier token to be scored from (a flat forward would read it from a "
                "padding position). Give every prompt at least one token, e.g. the tokenizer's BOS token or a chat "
                "template's header."
            )
        if len(completion) == 0:
            raise ValueError(
                f"{source} returned an empty completion for sample {i} (prompt {_preview(prompt, decode)}): every "
                "completion needs at least one token. Return the EOS token for an empty answer, or leave the sample "
                "out of the batch."
            )


def checked_rollout_func(rollout_func: Callable, decode: Callable | None = None) -> Callable:
    """`rollout_func` whose output's `prompt_ids` / `completion_ids` pass `check_rollouts` before TRL reads them."""

    @functools.wraps(rollout_func)
    def checked(prompts, trainer):
        output = rollout_func(prompts, trainer)
        if isinstance(output, dict) and {"prompt_ids", "completion_ids"} <= output.keys():
            check_rollouts(output["prompt_ids"], output["completion_ids"], "rollout_func", decode)
        return output

    return checked
