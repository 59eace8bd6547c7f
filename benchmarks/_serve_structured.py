"""The structured-outputs and tool-calling section of :mod:`benchmarks.energon_serve`: ``tightfit serve`` against
``vllm serve`` on the same model, driven by this module's own client (``vllm bench serve`` sends neither
``response_format`` nor ``tools``), the same requests to both.

Workloads, each at :data:`RATE` requests/s (Poisson arrivals, seeded: round ``r`` sends the same requests at the
same times to both servers; rounds alternate which server goes first), through ``/v1/chat/completions``, streamed
(``stream_options.include_usage``: the output tokens each server counted):

* ``schema``: ``response_format`` ``json_schema`` (strict) of :class:`Invoice`, a nested Pydantic model of 20
  fields; each output validated by Pydantic (``Invoice.model_validate_json``), independently of both servers;
* ``unconstrained``: the same prompts with no schema, each request's ``max_tokens`` the output tokens that server
  gave it under the schema (``ignore_eos``): the same tokens at the same times, so the tokens/s compare;
* ``tools``: three tools (:data:`TOOLS`), ``tool_choice`` ``"required"`` and a named function alternating; valid
  when every call names a tool offered (the named one where named) and its arguments validate against that tool's
  Pydantic model;
* ``fresh`` / ``cached``: one request at a time, time to first token with a schema neither server has seen (a
  variant of :class:`Invoice` whose bounds differ per request) and with the one already used;
* ``stall``: unconstrained requests at :data:`RATE` while a request with a large schema never seen (:func:`large_schema`)
  compiles: their time to first token against the same requests without it.

vLLM runs configured alike (:data:`VLLM_STRUCTURED`: compact JSON, as energon writes it; its default grammar lets a
model write whitespace between JSON tokens, which random weights do until ``max_tokens``, so few outputs end and
its tokens/s counts whitespace); :func:`run_schema_validity` measures the default's valid fraction once, as a note.
Valid fractions are each server's own; every ratio is paired per round (:func:`benchmarks.common.paired`).
Targets (issue 57): 100% valid; energon's tokens/s with the schema >= 0.9x its unconstrained; >= 1.0x vLLM's with
the same schema; TTFT fresh <= 1.2x cached.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any, Literal

import httpx
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from benchmarks.common import format_paired, paired

__all__ = ["Invoice", "TOOLS", "CHAT_TEMPLATE", "RATE", "VLLM_STRUCTURED", "add_chat_template", "large_schema",
           "fresh_schema", "run_round", "run_schema_validity", "summarize", "markdown"]

RATE = 16.0  # requests/s
# An Invoice is ~490 characters at most; random weights write strings of any characters, up to ~3 byte tokens each.
MAX_TOKENS = 900
TOOL_MAX_TOKENS = 300  # the tools' arguments are shorter, and the tools themselves fill the prompt
#: vLLM's structured-outputs setting in the paired rounds (``--structured-outputs-config``; vLLM 0.32): JSON
#: without free whitespace, as energon writes it (vLLM takes that with the xgrammar or guidance backend only, not
#: ``auto``; ``auto`` picks xgrammar for these schemas).
VLLM_STRUCTURED = {"backend": "xgrammar", "disable_any_whitespace": True}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")  # additionalProperties: false, as OpenAI's strict mode asks


class Address(_Strict):
    street: str = Field(max_length=24)
    city: str = Field(max_length=16)
    postcode: str = Field(pattern=r"^[0-9]{5}$")
    country: Literal["DE", "FR", "GB", "US", "JP"]


class Customer(_Strict):
    id: int = Field(ge=1, le=99999)
    name: str = Field(max_length=20)
    email: str = Field(max_length=24)
    vip: bool
    address: Address


class LineItem(_Strict):
    sku: str = Field(pattern=r"^[A-Z]{3}-[0-9]{4}$")
    description: str = Field(max_length=24)
    quantity: int = Field(ge=1, le=50)
    unit_cents: int = Field(ge=0, le=100000)


class Invoice(_Strict):
    """A nested schema of 20 fields (objects, arrays, enums, patterns, bounded numbers and strings)."""

    number: int = Field(ge=1, le=999999)
    issued: str = Field(pattern=r"^20[0-9]{2}-[01][0-9]-[0-3][0-9]$")
    currency: Literal["EUR", "USD", "GBP", "JPY"]
    customer: Customer
    items: list[LineItem] = Field(min_length=1, max_length=3)
    total_cents: int = Field(ge=0, le=10000000)
    paid: bool
    notes: str = Field(max_length=32)


class WeatherArgs(_Strict):
    city: str = Field(max_length=20)
    unit: Literal["celsius", "fahrenheit"]


class OrderSearchArgs(_Strict):
    customer_id: int = Field(ge=1, le=99999)
    status: Literal["open", "shipped", "returned"]
    limit: int = Field(ge=1, le=20)


class TicketArgs(_Strict):
    title: str = Field(max_length=24)
    priority: Literal["low", "normal", "high"]
    tags: list[Literal["billing", "bug", "account", "other"]] = Field(max_length=3)


_TOOL_ARGS: dict[str, type[BaseModel]] = {"get_weather": WeatherArgs, "search_orders": OrderSearchArgs,
                                          "create_ticket": TicketArgs}
TOOLS = [{"type": "function", "function": {"name": name, "description": name.replace("_", " "), "strict": True,
                                           "parameters": model.model_json_schema()}}
         for name, model in _TOOL_ARGS.items()]
NAMED = "create_ticket"

# A Qwen 2.5-style template (tools in a system block, calls as <tool_call> blocks): both servers render the tools
# with it; energon reads its tool-call format (hermes) from it.
CHAT_TEMPLATE = """{%- if tools %}<|im_start|>system
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Call a function with <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def add_chat_template(model: Path) -> Path:
    """Give the benchmark's model (:func:`benchmarks.energon_serve.make_model`) a chat template that renders tools."""
    (model / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return model


def fresh_schema(i: int) -> dict[str, Any]:
    """:class:`Invoice`'s schema with bounds of its own (``i``): a grammar no server has compiled before."""
    schema = json.loads(json.dumps(Invoice.model_json_schema()))
    schema["properties"]["notes"]["maxLength"] = 8 + i % 1000
    schema["properties"]["number"]["maximum"] = 999999 - i
    return schema


def large_schema(fields: int, nonce: int) -> dict[str, Any]:
    """An object of ``fields`` required properties (enums of 12 words, patterns, bounded integers and strings,
    small nested objects): slow to compile for a large vocabulary; ``nonce`` makes it one no server has seen."""
    rng = random.Random(nonce)
    props: dict[str, Any] = {}
    for k in range(fields):
        kind = k % 4
        if kind == 0:
            props[f"e{k}_{nonce}"] = {"enum": [f"w{rng.randrange(10**6)}" for _ in range(12)]}
        elif kind == 1:
            props[f"p{k}"] = {"type": "string", "pattern": f"^[A-Z]{{2}}[0-9]{{{1 + k % 5}}}-[a-z]{{1,{2 + k % 7}}}$"}
        elif kind == 2:
            props[f"i{k}"] = {"type": "integer", "minimum": -k, "maximum": 1000 + rng.randrange(10**5)}
        else:
            props[f"o{k}"] = {"type": "object", "additionalProperties": False, "required": ["s", "b"],
                              "properties": {"s": {"type": "string", "maxLength": 4 + k % 9}, "b": {"type": "boolean"}}}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def _messages(i: int, seed: int, what: str) -> list[dict[str, str]]:
    rng = random.Random(seed * 100003 + i)
    who = rng.choice(["Ada", "Grace", "Linus", "Margaret", "Ken", "Barbara", "Edsger", "Frances"])
    return [{"role": "user", "content": f"{what} number {rng.randrange(10**6)} for {who}, {rng.randrange(50)} items"}]


def _fmt(schema: dict[str, Any], name: str = "invoice") -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


# ---------------------------------------------------------------------- the client


async def send(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> dict[str, Any]:
    """One streamed chat completion: time to first token (the first content or tool-call delta), end-to-end time,
    the output tokens the server counted, the text and the tool calls put together from their deltas."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first: float | None = None
    text: list[str] = []
    calls: dict[int, dict[str, str]] = {}
    tokens, finish, error = 0, None, ""
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                error = f"{r.status_code}: {(await r.aread()).decode()[:300]}"
            async for line in r.aiter_lines() if not error else _nothing():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    tokens = int(chunk["usage"].get("completion_tokens") or 0)
                for c in chunk.get("choices", []):
                    delta = c.get("delta") or {}
                    if delta.get("content") or delta.get("tool_calls"):
                        first = first if first is not None else time.perf_counter()
                    text.append(delta.get("content") or "")
                    for tc in delta.get("tool_calls") or []:
                        call = calls.setdefault(int(tc.get("index", 0)), {"name": "", "arguments": ""})
                        fn = tc.get("function") or {}
                        call["name"] += fn.get("name") or ""
                        call["arguments"] += fn.get("arguments") or ""
                    finish = c.get("finish_reason") or finish
    except httpx.HTTPError as exc:
        error = f"{type(exc).__name__}: {exc}"
    end = time.perf_counter()
    return {"sent": t0, "ttft": None if first is None else first - t0, "e2e": end - t0, "end": end, "tokens": tokens,
            "text": "".join(text), "tool_calls": [calls[k] for k in sorted(calls)], "finish": finish, "error": error}


async def _nothing() -> Any:
    return
    yield


async def at_rate(url: str, bodies: list[dict[str, Any]], rate: float, seed: int,
                  extra: list[tuple[float, dict[str, Any]]] = ()) -> tuple[list[dict[str, Any]], float]:
    """``bodies`` sent at Poisson times of ``rate`` (seeded), ``extra`` at their own offsets (s); the results in
    order (extra last) and the wall time from the first send to the last answer."""
    rng = random.Random(seed)
    at, times = 0.0, []
    for _ in bodies:
        times.append(at)
        at += rng.expovariate(rate)
    limits = httpx.Limits(max_connections=len(bodies) + len(extra) + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        start = time.perf_counter()

        async def later(delay: float, body: dict[str, Any]) -> dict[str, Any]:
            await asyncio.sleep(max(0.0, start + delay - time.perf_counter()))
            return await send(client, url, body)

        rows = await asyncio.gather(*(later(t, b) for t, b in zip(times, bodies)),
                                    *(later(t, b) for t, b in extra))
    return list(rows), max(r["end"] for r in rows) - start


def schema_valid(row: dict[str, Any], model: type[BaseModel] = Invoice) -> bool:
    if row.get("error"):
        return False
    try:
        model.model_validate_json(row["text"])
    except ValidationError:
        return False
    return True


def tools_valid(row: dict[str, Any], named: str | None) -> bool:
    if row.get("error") or not row["tool_calls"]:
        return False
    for call in row["tool_calls"]:
        model = _TOOL_ARGS.get(call["name"])
        if model is None or (named is not None and call["name"] != named):
            return False
        try:
            model.model_validate_json(call["arguments"])
        except ValidationError:
            return False
    return True


# ---------------------------------------------------------------------- one round against one server


def _tok_s(rows: list[dict[str, Any]], wall: float) -> float:
    return sum(r.get("tokens", 0) for r in rows) / wall if wall > 0 else 0.0


def _median(xs: list[float | None]) -> float:
    got = [x for x in xs if x is not None]
    return statistics.median(got) if got else float("nan")


async def _round(url: str, n: int, seed: int, large_fields: int, max_tokens: int) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=30) as client:  # the name each server serves its model under
        name = (await client.get(url + "/v1/models")).json()["data"][0]["id"]
    return await _workloads(url, name, n, seed, large_fields, max_tokens)


async def _schema(url: str, m: str, n: int, seed: int, max_tokens: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The ``schema`` workload: its figures and the bodies sent."""
    bodies = [{"model": m, "messages": _messages(i, seed, "Write the invoice"), "max_tokens": max_tokens,
               "temperature": 1.0, "seed": seed * 1000 + i, "response_format": _fmt(Invoice.model_json_schema())}
              for i in range(n)]
    rows, wall = await at_rate(url, bodies, RATE, seed)
    return {"tok_s": _tok_s(rows, wall), "valid": sum(map(schema_valid, rows)), "n": n,
            "ttft_ms": 1e3 * _median([r["ttft"] for r in rows]), "wall_s": wall,
            "tokens": [r.get("tokens", 0) for r in rows], "errors": [r["error"] for r in rows if r.get("error")][:3],
            "finish_length": sum(r["finish"] == "length" for r in rows),
            "invalid": [(r["finish"], r["text"][-160:]) for r in rows
                        if not r.get("error") and not schema_valid(r)][:2]}, bodies


async def _workloads(url: str, m: str, n: int, seed: int, large_fields: int, max_tokens: int) -> dict[str, Any]:
    schema = Invoice.model_json_schema()
    got, bodies = await _schema(url, m, n, seed, max_tokens)
    out: dict[str, Any] = {"schema": got}
    # The same prompts unconstrained, each to the output length this server gave it under the schema.
    free = [{**{k: v for k, v in b.items() if k != "response_format"}, "max_tokens": max(1, m), "ignore_eos": True}
            for b, m in zip(bodies, out["schema"]["tokens"])]
    rows, wall = await at_rate(url, free, RATE, seed)
    out["unconstrained"] = {"tok_s": _tok_s(rows, wall), "ttft_ms": 1e3 * _median([r["ttft"] for r in rows]),
                            "wall_s": wall}
    tools = [{"model": m, "messages": _messages(i, seed, "File a ticket about order"), "tools": TOOLS,
              "tool_choice": "required" if i % 2 == 0 else {"type": "function", "function": {"name": NAMED}},
              "max_tokens": min(max_tokens, TOOL_MAX_TOKENS), "temperature": 1.0, "seed": seed * 1000 + i}
             for i in range(n)]
    rows, wall = await at_rate(url, tools, RATE, seed + 1)
    out["tools"] = {"tok_s": _tok_s(rows, wall), "n": n, "ttft_ms": 1e3 * _median([r["ttft"] for r in rows]),
                    "valid": sum(tools_valid(r, None if i % 2 == 0 else NAMED) for i, r in enumerate(rows)),
                    "errors": [r["error"] for r in rows if r.get("error")][:3]}
    # Time to first token, one request at a time: a schema never seen against the one used above.
    k = max(2, n // 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        one = {"model": m, "messages": _messages(0, seed, "Write the invoice"), "max_tokens": 8, "temperature": 0}
        fresh, cached = [], []
        for j in range(k):
            nonce = seed * 1000 + j
            fresh.append((await send(client, url, {**one, "response_format": _fmt(fresh_schema(nonce))}))["ttft"])
            cached.append((await send(client, url, {**one, "response_format": _fmt(schema)}))["ttft"])
    out["fresh_ms"], out["cached_ms"] = 1e3 * _median(fresh), 1e3 * _median(cached)
    # Unconstrained requests with and without a large schema compiling beside them (sent 0.1 s in).
    short = [{"model": m, "messages": _messages(i, seed, "Say something"), "max_tokens": 8, "ignore_eos": True,
              "temperature": 0} for i in range(n)]
    alone, _ = await at_rate(url, short, RATE, seed + 2)
    big = {"model": m, "messages": _messages(0, seed, "Fill the form"), "max_tokens": 8, "temperature": 0,
           "response_format": _fmt(large_schema(large_fields, seed), "form")}
    beside, _ = await at_rate(url, short, RATE, seed + 2, extra=[(0.1, big)])
    held = beside[-1]
    compiled_at = held["sent"] + (held["ttft"] if held["ttft"] is not None else held["e2e"])
    during = [r["ttft"] for r in beside[:-1] if r["ttft"] is not None and held["sent"] <= r["sent"] < compiled_at]
    out["stall"] = {"alone_ms": 1e3 * _median([r["ttft"] for r in alone]), "during_ms": 1e3 * _median(during),
                    "during_n": len(during), "large_ttft_ms": 1e3 * (compiled_at - held["sent"]),
                    "large_error": held.get("error", "")}
    return out


def run_round(url: str, n: int, seed: int, large_fields: int = 400, max_tokens: int = MAX_TOKENS) -> dict[str, Any]:
    """Every workload once against the server at ``url``, seeded (the other server of the round gets the same
    ``seed``: the same requests at the same times)."""
    return asyncio.run(_round(url, n, seed, large_fields, max_tokens))


def run_schema_validity(url: str, n: int, seed: int, max_tokens: int = MAX_TOKENS) -> dict[str, Any]:
    """The ``schema`` workload alone against the server at ``url`` (a server at its defaults: the note)."""
    async def go() -> dict[str, Any]:
        async with httpx.AsyncClient(timeout=30) as client:
            name = (await client.get(url + "/v1/models")).json()["data"][0]["id"]
        return (await _schema(url, name, n, seed, max_tokens))[0]

    return asyncio.run(go())


# ---------------------------------------------------------------------- summary and report


def _paired(a: list[float], b: list[float], higher_is_better: bool = True) -> dict[str, object] | None:
    """:func:`benchmarks.common.paired`, or None where a round of either measured nothing (every request failed)."""
    if any(not x > 0 for x in [*a, *b]):  # 0 or nan
        return None
    return paired(a, b, higher_is_better=higher_is_better)


def _ratio(p: dict[str, object] | None) -> str:
    return "n/a (a round measured nothing)" if p is None else format_paired(p)


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Medians per server and the paired ratios, from each server's rounds (round ``r`` of both: the same requests)."""
    e, v = runs["energon"], runs["vllm"]

    def col(rows: list[dict[str, Any]], *path: str) -> list[float]:
        out = []
        for r in rows:
            for p in path:
                r = r[p]
            out.append(float(r))  # type: ignore[arg-type]
        return out

    def med(rows: list[dict[str, Any]]) -> dict[str, float]:
        return {"schema_tok_s": statistics.median(col(rows, "schema", "tok_s")),
                "unconstrained_tok_s": statistics.median(col(rows, "unconstrained", "tok_s")),
                "tools_tok_s": statistics.median(col(rows, "tools", "tok_s")),
                "schema_valid": sum(col(rows, "schema", "valid")) / sum(col(rows, "schema", "n")),
                "tools_valid": sum(col(rows, "tools", "valid")) / sum(col(rows, "tools", "n")),
                "schema_ttft_ms": statistics.median(col(rows, "schema", "ttft_ms")),
                "fresh_ms": statistics.median(col(rows, "fresh_ms")),
                "cached_ms": statistics.median(col(rows, "cached_ms")),
                "stall_alone_ms": statistics.median(col(rows, "stall", "alone_ms")),
                "stall_during_ms": statistics.median(col(rows, "stall", "during_ms")),
                "large_ttft_ms": statistics.median(col(rows, "stall", "large_ttft_ms"))}

    return {"energon": med(e), "vllm": med(v), "paired": {
        "schema_vs_unconstrained": _paired(col(e, "schema", "tok_s"), col(e, "unconstrained", "tok_s")),
        "schema_vs_vllm": _paired(col(e, "schema", "tok_s"), col(v, "schema", "tok_s")),
        "tools_vs_vllm": _paired(col(e, "tools", "tok_s"), col(v, "tools", "tok_s")),
        "fresh_vs_cached": _paired(col(e, "fresh_ms"), col(e, "cached_ms"), higher_is_better=False),
        "vllm_fresh_vs_cached": _paired(col(v, "fresh_ms"), col(v, "cached_ms"), higher_is_better=False),
        "stall": _paired(col(e, "stall", "during_ms"), col(e, "stall", "alone_ms"), higher_is_better=False),
        "vllm_stall": _paired(col(v, "stall", "during_ms"), col(v, "stall", "alone_ms"), higher_is_better=False)}}


def markdown(res: dict[str, Any]) -> str:
    s, p = res["summary"], res["summary"]["paired"]
    e, v = s["energon"], s["vllm"]
    lines = [f"**Structured outputs and tool calls** ({res['shape']}, {res['layers']} layers, vocabulary "
             f"{res['vocab']}): this benchmark's own client (httpx, streamed chat completions) sends the same requests "
             f"to both servers at {RATE:g} requests/s (Poisson, seeded per round), {res['n']} per workload, "
             f"{res['rounds']} paired rounds; vLLM with `--structured-outputs-config "
             f"'{json.dumps(VLLM_STRUCTURED)}'` (compact JSON, as energon writes it). Schema: a strict `response_format` of a nested 20-field Pydantic model, each output validated "
             "by Pydantic; tools: 3 tools, `tool_choice` `required` and a named function alternating, each call's "
             "arguments validated against its tool's model. Unconstrained: the same prompts, each to the output "
             "length that server gave it under the schema. Fresh / cached: one request at a time, a schema never seen "
             "against one already compiled. Stall: unconstrained requests' time to first token while a "
             f"{res['large_fields']}-field schema compiles beside them, against the same requests alone.", "",
             "| | energon | vLLM |", "|---|---|---|",
             f"| schema outputs valid | {e['schema_valid']:.0%} | {v['schema_valid']:.0%} |",
             f"| tool calls valid | {e['tools_valid']:.0%} | {v['tools_valid']:.0%} |",
             f"| output tok/s with the schema | {e['schema_tok_s']:.1f} | {v['schema_tok_s']:.1f} |",
             f"| output tok/s unconstrained (same lengths) | {e['unconstrained_tok_s']:.1f} | "
             f"{v['unconstrained_tok_s']:.1f} |",
             f"| output tok/s with tools | {e['tools_tok_s']:.1f} | {v['tools_tok_s']:.1f} |",
             f"| TTFT with the schema, median ms | {e['schema_ttft_ms']:.0f} | {v['schema_ttft_ms']:.0f} |",
             f"| TTFT fresh / cached schema, ms | {e['fresh_ms']:.0f} / {e['cached_ms']:.0f} | "
             f"{v['fresh_ms']:.0f} / {v['cached_ms']:.0f} |",
             f"| TTFT of others alone / beside a large compile, ms | {e['stall_alone_ms']:.0f} / "
             f"{e['stall_during_ms']:.0f} | {v['stall_alone_ms']:.0f} / {v['stall_during_ms']:.0f} |",
             f"| large schema's own TTFT, ms | {e['large_ttft_ms']:.0f} | {v['large_ttft_ms']:.0f} |", "",
             "Paired ratios (median, rounds won, range) against the targets:", "",
             f"- energon tok/s with the schema / unconstrained: {_ratio(p['schema_vs_unconstrained'])} "
             "(target >= 0.9x)",
             f"- energon / vLLM tok/s with the same schema: {_ratio(p['schema_vs_vllm'])} (target >= 1.0x); "
             f"with tools: {_ratio(p['tools_vs_vllm'])}",
             f"- TTFT fresh / cached schema: energon {_ratio(p['fresh_vs_cached'])} (target <= 1.2x), vLLM "
             f"{_ratio(p['vllm_fresh_vs_cached'])}",
             f"- TTFT of unconstrained requests beside a large compile / alone: energon {_ratio(p['stall'])}, "
             f"vLLM {_ratio(p['vllm_stall'])}"]
    d = res.get("vllm_default")
    if d is not None:
        lines += ["", f"Note: vLLM at its default structured-outputs settings (whitespace allowed between JSON tokens), "
                      f"the schema workload once: {d['valid']}/{d['n']} outputs valid, {d['finish_length']} cut at "
                      f"`max_tokens`, {d['tok_s']:.1f} output tok/s (whitespace counted)."]
    return "\n".join(lines)
