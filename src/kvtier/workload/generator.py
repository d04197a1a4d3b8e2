"""Seeded synthetic chat sessions: arrivals, turns, pauses and real-prose messages.

The model, per session:

- sessions arrive as a renewal process with Gamma-distributed gaps of mean `1/session_rate`
  and coefficient of variation `arrival_cv` (cv 1 is a Poisson process; above 1, bursts);
- each session picks an app (its system prompt) and a tenant uniformly; with probability
  `document_share` its first message carries a document of `document_tokens`. With
  `classes`, it picks an app class by share instead, and draws its turns, think times and
  lengths from that class's fields (one system prompt per class, shared by its sessions);
- after each turn the user leaves with probability `1/mean_turns` (abandonment, so turns per
  session are geometric with that mean, capped at `max_turns`); otherwise they return after a
  think time drawn from a two-part mixture: a quick follow-up (lognormal, median
  `followup_median_s`) with probability `followup_share`, else a pause of minutes (lognormal,
  median `pause_median_s`);
- the next turn arrives `output_tokens / decode_tok_s` (the answer being written) plus that
  think time after the previous one.

One numpy Generator drives every draw in a fixed order, so a seed fixes the whole workload.
"""

from __future__ import annotations

import math

import numpy as np

from kvtier.session_hints import SessionHints
from kvtier.workload.config import GeneratorConfig
from kvtier.workload.model import Session, Turn, Workload
from kvtier.workload.presets import preset_config
from kvtier.workload.text import Corpus, LengthFn, approx_tokens, load_corpus


def generate(
    config: GeneratorConfig | str = "quick", seed: int = 0, length: LengthFn = approx_tokens
) -> Workload:
    """A workload from a config or preset name. `length` measures text in tokens (a
    tokenizer's `lambda s: len(tok.encode(s))`, or the 1.3 tokens/word estimate)."""
    name = config if isinstance(config, str) else "custom"
    if isinstance(config, str):
        config = preset_config(config)
    rng = np.random.default_rng(seed)
    corpus = load_corpus()
    system_prompts = [
        corpus.text_of_tokens(rng, config.system_prompt_tokens, length)
        if config.system_prompt_tokens
        else ("", 0)
        for _ in range(config.apps)
    ]
    classes = _classes(rng, config, corpus, length)
    # where any session calls tools, every reply says how it ended, as a server's would
    ends_known = bool(config.tools) or any(c.tools for _, c, _ in classes)
    starts = session_starts(rng, config.sessions, config.session_rate, config.arrival_cv)
    sessions = []
    for index, start in enumerate(starts):
        if classes:
            name, drawn_from, (system_prompt, system_tokens) = classes[_pick(rng, config)]
            app_class = name
        else:
            app = int(rng.integers(config.apps))
            drawn_from, app_class = config, f"app{app}"
            system_prompt, system_tokens = system_prompts[app]
        tenant = int(rng.integers(config.tenants))
        session = Session(
            session_id=f"s{index:05d}",
            turns=_turns(rng, drawn_from, corpus, length, float(start), ends_known),
            tenant=f"tenant{tenant}",
            app_class=app_class,
            system_prompt=system_prompt,
            system_tokens=system_tokens,
        )
        sessions.append(session)
    return Workload(
        sessions=sessions,
        source=f"generator preset={name} seed={seed}",
        block_size=config.block_size,
        max_history_tokens=config.max_history_tokens,
    )


def _classes(
    rng: np.random.Generator, config: GeneratorConfig, corpus: Corpus, length: LengthFn
) -> list[tuple[str, GeneratorConfig, tuple[str, int]]]:
    """Per app class (in the config's order): its name, the config its sessions draw from, and
    its system prompt, shared by all its sessions (a document Q&A class's long shared prefix)."""
    out = []
    for name in config.classes or {}:
        drawn_from = config.of_class(name)
        tokens = drawn_from.system_prompt_tokens
        prompt = corpus.text_of_tokens(rng, tokens, length) if tokens else ("", 0)
        out.append((name, drawn_from, prompt))
    return out


def _pick(rng: np.random.Generator, config: GeneratorConfig) -> int:
    shares = np.array([spec.share for spec in (config.classes or {}).values()])
    return int(rng.choice(len(shares), p=shares / shares.sum()))


def session_starts(rng: np.random.Generator, count: int, rate: float, cv: float) -> np.ndarray:
    """Arrival times of `count` sessions, the first at 0: Gamma gaps of mean 1/rate, cv `cv`."""
    shape = 1.0 / cv**2
    gaps = rng.gamma(shape, 1.0 / (rate * shape), size=count - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])


def think_time(rng: np.random.Generator, config: GeneratorConfig) -> float:
    """The user's pause before returning: a quick follow-up or a pause of minutes."""
    if rng.random() < config.followup_share:
        median, sigma = config.followup_median_s, config.followup_sigma
    else:
        median, sigma = config.pause_median_s, config.pause_sigma
    return float(rng.lognormal(math.log(median), sigma))


def next_arrival(previous: Turn, think_s: float, decode_tok_s: float) -> float:
    """When the next turn arrives: after the previous answer is written and the user thinks."""
    return previous.arrival_s + previous.output_tokens / decode_tok_s + think_s


def _turns(
    rng: np.random.Generator,
    config: GeneratorConfig,
    corpus: Corpus,
    length: LengthFn,
    start: float,
    ends_known: bool = False,
) -> list[Turn]:
    with_document = config.document_tokens is not None and rng.random() < config.document_share
    turns: list[Turn] = []
    arrival, think, result = start, None, None
    context = config.system_prompt_tokens
    while True:
        target = result.result_tokens.sample(rng) if result else config.user_tokens.sample(rng)
        if with_document and not turns:
            target += config.document_tokens.sample(rng)
        user_text, user_tokens = corpus.text_of_tokens(rng, target, length)
        answer_text, output_tokens = corpus.text_of_tokens(
            rng, config.answer_tokens.sample(rng), length
        )
        turn = Turn(
            arrival_s=arrival,
            user_tokens=user_tokens,
            output_tokens=output_tokens,
            user_text=user_text,
            answer_text=answer_text,
            think_s=think,
        )
        turns.append(turn)
        context += user_tokens + output_tokens
        # No draws for workloads without tools: their sessions stay as they were generated.
        tool = _tool_call(rng, config) if config.tools else None
        if ends_known:
            turn.end, turn.tool = ("tool_call", tool) if tool else ("answer", None)
        if (
            len(turns) >= config.max_turns
            or _context_full(config, context)
            or (tool is None and rng.random() < config.abandon_prob)
        ):
            if config.hints:
                turn.hints = SessionHints(close=True)
            return turns
        if tool is not None:
            result = config.tools[tool]
            think = result.duration(rng)  # the agent returns when its tool does
            if config.hints:
                turn.hints = SessionHints(expect_return_s=result.duration_median_s)
        else:
            result, think = None, think_time(rng, config)
        arrival = next_arrival(turn, think, config.decode_tok_s)


def _context_full(config: GeneratorConfig, context: int) -> bool:
    """An agent whose context has no room for another tool result and reply stops there (its
    harness would compact or start over; dropping the oldest turns instead would change the
    prompt's prefix, and so recompute the whole history, at every later turn)."""
    if not config.tools or config.max_history_tokens is None:
        return False
    largest = max(tool.result_tokens.max_tokens for tool in config.tools.values())
    return context + largest + config.answer_tokens.max_tokens > config.max_history_tokens


def _tool_call(rng: np.random.Generator, config: GeneratorConfig) -> str | None:
    """The tool this reply calls, or None when it is an answer."""
    if rng.random() >= config.tool_call_share:
        return None
    names = list(config.tools or {})
    shares = np.array([config.tools[name].share for name in names])
    return names[int(rng.choice(len(names), p=shares / shares.sum()))]
