"""Render a chat request's prompt text with the model's template, as vLLM does (continue_final_message)."""

from __future__ import annotations

from typing import Any

from kvgate.chat_template import compile_chat_template

_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def render_chat_template(
    source: str,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: list[dict[str, Any]] | None = None,
    documents: list[dict[str, Any]] | None = None,
    **variables: Any,
) -> str:
    """The prompt text for messages; with continue_final_message the text stops after the last message."""
    chat = [{k: v for k, v in dict(m).items() if v is not None} for m in messages]
    final = None
    if continue_final_message:
        if not chat or not isinstance(chat[-1].get("content"), str):
            raise ValueError("continue_final_message needs a final message with string content")
        final = chat[-1]["content"]
        chat[-1] = {**chat[-1], "content": final + _CONTINUE_TAG}
    rendered = compile_chat_template(source).render(
        messages=chat, tools=tools, documents=documents, add_generation_prompt=add_generation_prompt, **variables
    )
    if final is None:
        return rendered
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in rendered or tag not in rendered:
        raise ValueError("continue_final_message: the chat template dropped part of the final message")
    loc = rendered.rindex(tag)
    if rendered[loc : loc + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:loc]
    return rendered[:loc].rstrip()
