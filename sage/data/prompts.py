"""The output format of the paper (docs/method.md, "What the paper ran and reports"), shared by training,
evaluation and the testbed.

A completion is ``<start_working_out> ... <end_working_out><SOLUTION> answer </SOLUTION>``. Train and eval
build prompts with the same function so that they can never disagree on the template.
"""

from __future__ import annotations

WORK_START = "<start_working_out>"
WORK_END = "<end_working_out>"
SOLUTION_START = "<SOLUTION>"
SOLUTION_END = "</SOLUTION>"

SYSTEM_PROMPT = (
    "You are given a problem.\n"
    "Think about the problem and provide your working out.\n"
    f"Place it between {WORK_START} and {WORK_END}.\n"
    f"Then, provide your solution between {SOLUTION_START}{SOLUTION_END}"
)


def make_prompt(problem: str, chat: bool) -> str | list[dict[str, str]]:
    """Prompt in TRL's format: a chat conversation (system + user) for chat models, the bare problem
    text for the testbed's character-level model (whose teacher data has no system prompt)."""
    if chat:
        return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": problem}]
    return problem


def make_completion(text: str, chat: bool) -> str | list[dict[str, str]]:
    """An SFT target in the prompt's format: TRL's SFTTrainer joins prompt and completion, so a chat
    prompt (a message list) needs an assistant message, and a bare-text prompt a string."""
    return [{"role": "assistant", "content": text}] if chat else text
