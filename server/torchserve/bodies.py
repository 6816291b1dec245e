"""What TorchServe clients send to /predictions, read into one JSON object for the `llm`
handler's parser (pagedserve.handlers.llm_input):

- `application/json`: the JSON object (as before);
- `text/plain`: the whole body is the prompt (UTF-8), unless it is a JSON object (what a
  browser's `fetch` sends by default);
- `multipart/form-data` (`curl -F data=@file`), or a url-encoded form that names an input: a
  `data` or `body` field is the input (a JSON object, or else the prompt text); otherwise the
  fields are the body's fields (`prompt` as text, the rest read as JSON values when they
  parse: "8" -> 8);
- anything else (a PUT from `curl -T file`, `application/octet-stream`, what `curl -d` sends
  as a form that is not one): a body that starts with `{` is JSON, any other the prompt text.

TorchServe's LLM examples name the output length `max_new_tokens`: it is read as `max_tokens`
(both at once is a 400). Every refusal is an `ErrorReply` naming what is wrong: an empty body,
text that is not UTF-8, a multipart body without a boundary or with too many parts, a form
without an input field (400); a body over max_request_size is aiohttp's 413 before this runs.
"""

from __future__ import annotations

import asyncio
from email.message import Message
from typing import Any
from urllib.parse import parse_qsl

import msgspec

from pagedserve.handlers.base_handler import HandlerError
from pagedserve.handlers.llm_input import decode_body, rename_max_new_tokens
from pagedserve.server.serving.generation import ErrorReply

INPUT_FIELDS = ("data", "body")  # TorchServe's names for a request's input in a form
MAX_FORM_FIELDS = 64
MAX_PART_HEADER_BYTES = 8192
TEXT_FIELDS = frozenset({"prompt"})  # form fields that are always text, never JSON


def max_new_tokens(body: dict[str, Any]) -> dict[str, Any]:
    """TorchServe LLM examples' `max_new_tokens` -> `max_tokens` (pagedserve.handlers.llm_input)."""
    try:
        return rename_max_new_tokens(body)
    except HandlerError as exc:
        raise ErrorReply.from_handler_error(exc) from None


async def read_predictions_body(request, executor, max_bytes: int) -> dict[str, Any]:
    """The request's body as a /predictions JSON object (see the module's docstring)."""
    raw = await request.read()  # too large (413), unreadable (400), too slow (408): middleware
    if not raw.strip():
        raise ErrorReply(400, "the request body is empty: send a JSON object, or the prompt as text")
    kind = request.content_type
    if kind == "multipart/form-data":
        loop = asyncio.get_running_loop()  # a large form takes a while to split
        form = await loop.run_in_executor(executor, multipart_fields, raw, request.headers.get("Content-Type", ""))
        return max_new_tokens(form_body(form, max_bytes))
    if kind == "application/json" or (kind != "text/plain" and raw.lstrip()[:1] == b"{"):
        return max_new_tokens(_json(raw, max_bytes))
    if kind == "text/plain" and raw.lstrip()[:1] == b"{":  # a browser's fetch() sends JSON so
        try:
            return max_new_tokens(decode_body(raw, max_bytes))
        except HandlerError:
            pass  # not a JSON object: the prompt text
    if kind == "application/x-www-form-urlencoded":  # curl -d's type, whatever the body is
        fields = urlencoded_fields(raw)
        if fields is not None:
            return max_new_tokens(form_body(fields, max_bytes))
    return {"prompt": _text(raw, "the request body")}


def multipart_fields(raw: bytes, content_type: str) -> dict[str, bytes]:
    """The named parts of a multipart/form-data body (RFC 7578; the last one of a repeated name
    wins). Split with `bytes.find` on the boundary, so the time is linear in the body's size
    whatever it holds (a line-based parser takes seconds over megabytes of short lines)."""
    boundary = _param(content_type, "content-type", "boundary")
    if not boundary:
        raise ErrorReply(400, "multipart/form-data without a boundary parameter in Content-Type")
    if not boundary.isascii() or len(boundary) > 70:  # RFC 2046's rule
        raise ErrorReply(400, "the multipart boundary must be 1 to 70 ASCII characters")
    delimiter = b"--" + boundary.encode("ascii")
    first = raw.find(delimiter)
    if first < 0 or (first > 0 and raw[first - 2 : first] != b"\r\n"):
        raise ErrorReply(400, "the multipart/form-data body holds no parts (is the boundary right?)")
    fields: dict[str, bytes] = {}
    pos = first + len(delimiter)
    while raw[pos : pos + 2] != b"--":  # the close delimiter ends the body
        if len(fields) >= MAX_FORM_FIELDS:
            raise ErrorReply(400, f"the multipart/form-data body has more than {MAX_FORM_FIELDS} parts")
        line_end = raw.find(b"\r\n", pos)
        end = raw.find(b"\r\n" + delimiter, line_end)
        if line_end < 0 or end < 0:
            raise ErrorReply(400, "the multipart/form-data body is cut short: a part does not end with the boundary")
        name, value = _part(raw[line_end + 2 : end], len(fields))
        fields[name] = value
        pos = end + 2 + len(delimiter)
    if not fields:
        raise ErrorReply(400, "the multipart/form-data body holds no parts")
    return fields


def _part(part: bytes, i: int) -> tuple[str, bytes]:
    """A part's form name and content."""
    head_end = 0 if part.startswith(b"\r\n") else part.find(b"\r\n\r\n")
    if head_end < 0 or head_end > MAX_PART_HEADER_BYTES:
        raise ErrorReply(400, f"multipart part {i} has no header block (Content-Disposition) ending in an empty line")
    headers = part[:head_end].decode("latin-1").split("\r\n")
    content = part[head_end + (2 if head_end == 0 else 4) :]
    disposition = next(
        (h.partition(":")[2] for h in headers if h.partition(":")[0].strip().lower() == "content-disposition"), ""
    )
    name = _param(disposition, "content-disposition", "name")
    if not name:
        raise ErrorReply(400, f"multipart part {i} has no name (Content-Disposition: form-data; name=...)")
    return name, content


def _param(value: str, header: str, key: str) -> str | None:
    """A parameter of a header value (quoted or not), as the email package reads it."""
    message = Message()
    message[header] = value
    found = message.get_param(key, header=header)
    return found if isinstance(found, str) else None


def urlencoded_fields(raw: bytes) -> dict[str, bytes] | None:
    """The fields of a url-encoded form that names an input (`data`, `body`, `prompt` or
    `messages`), else None: `curl -d "Once upon a time"` sends its text with this type too."""
    try:
        pairs = parse_qsl(
            raw.decode("ascii"),
            keep_blank_values=True,
            strict_parsing=True,
            max_num_fields=MAX_FORM_FIELDS,
            encoding="latin-1",
        )  # bytes as they are
    except (UnicodeDecodeError, ValueError):
        return None
    fields = {name: value.encode("latin-1") for name, value in pairs}
    return fields if set(fields) & {*INPUT_FIELDS, "prompt", "messages"} else None


def form_body(fields: dict[str, bytes], max_bytes: int) -> dict[str, Any]:
    """Form fields -> a /predictions body: the input field, or the fields themselves."""
    for name in INPUT_FIELDS:
        if name in fields:
            others = sorted(set(fields) - {name})
            if others:
                raise ErrorReply(
                    400,
                    f"form field {name!r} is the whole input; other fields ({', '.join(others)}) belong inside it",
                    param=others[0],
                )
            value = fields[name]
            if value.lstrip()[:1] == b"{":
                return _json(value, max_bytes)
            return {"prompt": _text(value, f"form field {name!r}")}
    if "prompt" not in fields and "messages" not in fields:
        raise ErrorReply(
            400,
            "the form has no input: send a 'data' (or 'body') field with the "
            "prompt or a JSON object, or a 'prompt' field",
            param="data",
        )
    return {
        name: _text(value, f"form field {name!r}") if name in TEXT_FIELDS else _form_value(name, value)
        for name, value in fields.items()
    }


def _form_value(name: str, value: bytes) -> Any:
    """A JSON value when the field holds exactly one ("8", "true", '["\\n"]'), else its text."""
    text = _text(value, f"form field {name!r}")
    try:
        return msgspec.json.decode(value)
    except (msgspec.DecodeError, RecursionError):
        return text


def _json(raw: bytes, max_bytes: int) -> dict[str, Any]:
    try:
        return decode_body(raw, max_bytes)
    except HandlerError as exc:
        raise ErrorReply.from_handler_error(exc) from None


def _text(raw: bytes, what: str) -> str:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ErrorReply(400, f"{what} is not UTF-8 text (byte {exc.start})") from None
    if not text.strip():
        raise ErrorReply(400, f"{what} is empty: send the prompt")
    return text
