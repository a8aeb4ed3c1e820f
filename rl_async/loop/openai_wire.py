"""OpenAI's wire format for the gateway (rl_async.loop.gateway): what a request may ask and
how a reply is written, as one JSON object or as server-sent events (`stream: true`).

Request fields are honoured or refused with HTTP 400 naming the field, never silently
ignored:
- honoured: `messages` (roles system, developer = system, user, assistant, tool; string or
  text-part content), `tools`, `tool_choice` "auto" / "none" (no tool calls parsed),
  `max_tokens` / `max_completion_tokens` (capped by the run's limits), `stop` (a string or
  up to 4: the reply ends at the first, which is not returned; the tokens trained end with
  the token that completed it), `n` 1 or null, `stream` (+ `stream_options.include_usage`),
  `logprobs`, `return_token_ids`, `response_format` {"type": "text"};
- refused: `tool_choice` "required" or a named function and `response_format` json_object /
  json_schema (the engine cannot constrain decoding, and an unconstrained reply presented as
  conforming would be trained as if it did), `logit_bias`, `n` > 1;
- the run's own: temperature, top_p, seed and the like (the behaviour policy is the run's).
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass
from typing import Any


class GatewayRefusal(ValueError):
    """A call the gateway cannot serve token-in/token-out (HTTP 400, message quoted)."""


@dataclass(frozen=True)
class CallOptions:
    stop: tuple[str, ...] = ()
    tools_parsed: bool = True        # tool_choice "auto" (and tools given); "none": text only
    stream: bool = False
    include_usage: bool = False


def _text(content: Any, where: str) -> str:
    """A message's content: a string, or OpenAI content parts of type text."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    if content is None:
        return ""
    raise GatewayRefusal(f"{where}: content must be a string or text parts")


def messages(body: dict) -> list[dict]:
    raw = body.get("messages")
    if not isinstance(raw, list):
        raise GatewayRefusal("'messages' must be a list")
    out = []
    for i, m in enumerate(raw):
        role = m.get("role") if isinstance(m, dict) else None
        if role == "developer":  # OpenAI's system role for reasoning models
            role = "system"
        if role not in ("system", "user", "assistant", "tool"):
            raise GatewayRefusal(f"messages[{i}]: needs a role of system, developer, user, "
                                 f"assistant, tool")
        message = {"role": role, "content": _text(m.get("content"), f"messages[{i}]")}
        # Tool-call bookkeeping the template may render (assistant calls, tool results).
        message.update({k: m[k] for k in ("tool_calls", "tool_call_id", "name") if m.get(k)})
        out.append(message)
    return out


def tools(body: dict) -> list[dict] | None:
    given = body.get("tools")
    if given is None or given == []:
        return None
    if not (isinstance(given, list) and all(isinstance(t, dict) for t in given)):
        raise GatewayRefusal("'tools' must be a list of OpenAI tool objects")
    return given


def max_tokens(body: dict) -> int | None:
    value = body.get("max_completion_tokens", body.get("max_tokens"))
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise GatewayRefusal(f"max_tokens = {value!r}: a positive integer")
    return value


def options(body: dict) -> CallOptions:
    """The request's protocol options, or a GatewayRefusal naming the field it cannot
    honour."""
    n = body.get("n")
    if n not in (None, 1):
        raise GatewayRefusal(f"n = {n!r}: one choice per call (a group's samples are separate "
                             f"trajectories)")
    stop = body.get("stop")
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if not all(isinstance(s, str) and s for s in stops) or len(stops) > 4:
        raise GatewayRefusal(f"stop = {stop!r}: a non-empty string or a list of up to 4")
    choice = body.get("tool_choice", "auto")
    if choice not in (None, "auto", "none"):
        raise GatewayRefusal(f"tool_choice = {json.dumps(choice)}: only 'auto' and 'none' are "
                             f"served (the engine cannot force a tool call)")
    fmt = body.get("response_format")
    if fmt not in (None, {"type": "text"}):
        kind = fmt.get("type") if isinstance(fmt, dict) else fmt
        raise GatewayRefusal(f"response_format = {kind!r}: only 'text' is served (the engine "
                             f"cannot constrain decoding to a format)")
    if body.get("logit_bias"):
        raise GatewayRefusal("logit_bias: not served (the run's sampling is the behaviour "
                             "policy)")
    usage = body.get("stream_options") or {}
    return CallOptions(stops, choice != "none", bool(body.get("stream")),
                       bool(isinstance(usage, dict) and usage.get("include_usage")))


def error_body(status: int, message: str, kind: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def _logprob_entries(tokenizer, ids: list[int], logprobs: list[float]) -> list[dict]:
    out = []
    for t, lp in zip(ids, logprobs):
        text = tokenizer.decode([t])  # decoded text, as OpenAI returns (not a BPE piece)
        out.append({"token": text, "logprob": lp, "bytes": list(text.encode()),
                    "top_logprobs": []})
    return out


def response(kind: str, body: dict, reply, model: str, tokenizer) -> dict:
    """The whole reply as one JSON object (chat.completion or text_completion)."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": reply.finish_reason}
    if kind == "chat":
        choice["message"] = {"role": "assistant", "content": reply.content}
        if reply.tool_calls:
            choice["message"]["tool_calls"] = reply.tool_calls
            choice["finish_reason"] = "tool_calls"
        if body.get("logprobs"):
            choice["logprobs"] = {"content": _logprob_entries(tokenizer, reply.output_ids,
                                                              reply.logprobs)}
    else:
        choice["text"] = reply.text
        if body.get("logprobs") is not None:
            choice["logprobs"] = {"tokens": [tokenizer.decode([t]) for t in reply.output_ids],
                                  "token_logprobs": reply.logprobs, "top_logprobs": None,
                                  "text_offset": None}
    out = {"id": f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{secrets.token_hex(8)}",
           "object": "chat.completion" if kind == "chat" else "text_completion",
           "created": int(time.time()), "model": model, "choices": [choice],
           "usage": {"prompt_tokens": len(reply.prompt_ids),
                     "completion_tokens": len(reply.output_ids),
                     "total_tokens": len(reply.prompt_ids) + len(reply.output_ids)}}
    if body.get("return_token_ids"):
        out["prompt_token_ids"] = reply.prompt_ids
        choice["token_ids"] = reply.output_ids
    return out


def sse_events(kind: str, whole: dict, include_usage: bool) -> list[bytes]:
    """The same reply as OpenAI's server-sent events: a chunk opening the message, one with
    the content (and its log-probs and ids), one per tool call, one with the finish reason,
    the usage chunk when asked (stream_options.include_usage), then [DONE]. The reply is
    whole before the first event (a turn is generated, then parsed), so the events carry it
    in these few pieces."""
    choice = whole["choices"][0]
    head = {k: whole[k] for k in ("id", "created", "model")}
    head["object"] = "chat.completion.chunk" if kind == "chat" else "text_completion"
    chunks: list[dict] = []

    def chunk(delta_or_text: dict, finish: str | None = None, **extra) -> None:
        c: dict[str, Any] = {"index": 0, "finish_reason": finish, **extra}
        if kind == "chat":
            c["delta"] = delta_or_text
        else:
            c.update(delta_or_text)
        chunks.append({**head, "choices": [c]})

    ids = {"token_ids": choice["token_ids"]} if "token_ids" in choice else {}
    if kind == "chat":
        message = choice["message"]
        first = {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                      "finish_reason": None}]}
        if "prompt_token_ids" in whole:
            first["prompt_token_ids"] = whole["prompt_token_ids"]
        chunks.append(first)
        extra = {"logprobs": choice["logprobs"]} if "logprobs" in choice else {}
        if message.get("content"):
            chunk({"content": message["content"]}, **extra, **ids)
        elif extra or ids:
            chunk({}, **extra, **ids)
        for i, call in enumerate(message.get("tool_calls", [])):
            chunk({"tool_calls": [{"index": i, **call}]})
        chunk({}, choice["finish_reason"])
    else:
        extra = {"logprobs": choice["logprobs"]} if "logprobs" in choice else {}
        chunk({"text": choice["text"]}, **extra, **ids)
        chunk({"text": ""}, choice["finish_reason"])
    if include_usage:
        chunks.append({**head, "choices": [], "usage": whole["usage"]})
    return [f"data: {json.dumps(c)}\n\n".encode() for c in chunks] + [b"data: [DONE]\n\n"]
