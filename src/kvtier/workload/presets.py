"""Named generator configs.

- `quick`: a few dozen sessions for a short benchmark run of a 135M model on 2 CPU cores:
  prompts stay under ~2.5K tokens (history budget 2,048) and answers are 32-64 tokens.
- `demo`: what `kvtier bench --quick` (and `make demo`) replays through every policy on 2 CPU
  cores: 2 sessions of up to 3 turns, each opening with a ~4.4K-token document (about 4.2K
  tokens of SmolLM2 once rendered: recomputing one history takes seconds on a CPU), 8-16
  token answers (a decode step over 4K tokens of context is slow on a CPU too), every return
  after a pause of minutes (the replay clock skips those), so every later turn is resumed
  and the two histories compete for the device pool.
- `default`: a mixed population: chats with short messages next to sessions that open with a
  long document, four apps with their own system prompts, bursty arrivals, and about 40% of
  returns after a pause of minutes (resumed turns are a real share). Every gap is drawn
  independently of the session and its app: nothing observable tells which idle session
  returns soon (the hard case for a predictor).
- `multiclass`: three app classes whose return behaviour differs as Wang et al. (USENIX ATC'25,
  "KVCache Cache in the Wild") describe for API and chat traffic; the class is the session's
  app_class, as an API key's app would be. `agent`: tool loops that return in seconds, many
  turns, a long tool-description system prompt. `chat`: people who return after minutes or
  leave (about 2.5 turns). `docqa`: questions about one long document every session shares
  (a 12K-token system prompt), a follow-up after tens of seconds or a pause of minutes.
- `agentic`: coding agents beside chats, with the signals production traffic carries. An
  `agent` session works a task in a tool loop: 96% of its replies are tool calls (25 calls a
  task on average) and it returns when the tool does, with the result as its next message; an
  answer ends the task, and the user leaves or brings a new task after a pause. Tools differ
  in run time and result size: file reads and searches return in a fraction of a second, edits
  in about one, web lookups in seconds, test runs in tens of seconds to minutes (vLLM's AgentX
  traffic: median 43 turns and 142K input tokens a session; Continuum, arXiv 2511.02230:
  tool calls from sub-second functions to long test runs on SWE-Bench and OpenHands). The run
  times are our assumption in those ranges. Histories grow past 100K tokens; an agent whose
  context is full (110K, so a prompt and its reply fit 128K) stops there. A `chat` session
  ends in answers, returns after minutes or leaves. Replies say how they ended (tool call or
  answer) and which tool they called; no hints.
- `agentic-hints`: `agentic` with the client's hints: after a tool call, the expected return
  (the tool's median run time); on a session's last turn, close.
"""

from __future__ import annotations

from typing import Any

from kvtier.errors import KvtierError
from kvtier.workload.config import GeneratorConfig

PRESETS: dict[str, dict[str, Any]] = {
    "quick": {
        "sessions": 24,
        "session_rate": 0.2,
        "mean_turns": 3.0,
        "max_turns": 8,
        "followup_share": 0.6,
        "followup_median_s": 8.0,
        "pause_median_s": 90.0,
        "system_prompt_tokens": 96,
        "user_tokens": {"mean": 48, "cv": 0.6, "min_tokens": 8, "max_tokens": 192},
        "answer_tokens": {"mean": 48, "cv": 0.2, "min_tokens": 32, "max_tokens": 64},
        "document_share": 0.25,
        "document_tokens": {"mean": 900, "cv": 0.3, "min_tokens": 400, "max_tokens": 1500},
        "max_history_tokens": 2048,
    },
    "demo": {
        "sessions": 2,
        "session_rate": 0.1,
        "mean_turns": 3.0,
        "max_turns": 3,
        "followup_share": 0.0,
        "followup_median_s": 6.0,
        "pause_median_s": 120.0,
        "system_prompt_tokens": 96,
        "apps": 2,
        "user_tokens": {"mean": 40, "cv": 0.6, "min_tokens": 8, "max_tokens": 160},
        "answer_tokens": {"mean": 12, "cv": 0.25, "min_tokens": 8, "max_tokens": 16},
        "document_share": 1.0,
        "document_tokens": {"mean": 4600, "cv": 0.03, "min_tokens": 4400, "max_tokens": 4800},
        "max_history_tokens": 7000,
    },
    "default": {
        "sessions": 400,
        "session_rate": 0.2,
        "arrival_cv": 1.5,
        "mean_turns": 5.0,
        "max_turns": 40,
        "followup_share": 0.6,
        "followup_median_s": 12.0,
        "pause_median_s": 240.0,
        "system_prompt_tokens": 600,
        "apps": 4,
        "tenants": 3,
        "user_tokens": {"mean": 120, "cv": 1.0, "min_tokens": 4, "max_tokens": 2000},
        "answer_tokens": {"mean": 300, "cv": 0.8, "min_tokens": 8, "max_tokens": 2048},
        "document_share": 0.3,
        "document_tokens": {"mean": 6000, "cv": 0.8, "min_tokens": 1000, "max_tokens": 30000},
        "max_history_tokens": 32768,
    },
    "multiclass": {
        "sessions": 400,
        "session_rate": 0.25,
        "arrival_cv": 1.5,
        "mean_turns": 4.0,
        "max_turns": 40,
        "followup_share": 0.5,
        "followup_median_s": 10.0,
        "pause_median_s": 240.0,
        "system_prompt_tokens": 600,
        "tenants": 3,
        "user_tokens": {"mean": 120, "cv": 1.0, "min_tokens": 4, "max_tokens": 2000},
        "answer_tokens": {"mean": 300, "cv": 0.8, "min_tokens": 8, "max_tokens": 2048},
        "max_history_tokens": 32768,
        "classes": {
            "agent": {
                "share": 0.3,
                "set": {
                    "mean_turns": 10.0,
                    "followup_share": 1.0,
                    "followup_median_s": 3.0,
                    "followup_sigma": 0.6,
                    "system_prompt_tokens": 3000,
                    "user_tokens": {"mean": 400, "cv": 1.0, "min_tokens": 16, "max_tokens": 4000},
                    "answer_tokens": {"mean": 150, "cv": 0.8, "min_tokens": 8, "max_tokens": 1024},
                },
            },
            "chat": {
                "share": 0.45,
                "set": {
                    "mean_turns": 2.5,
                    "max_turns": 20,
                    "followup_share": 0.15,
                    "followup_median_s": 20.0,
                    "pause_median_s": 180.0,
                    "pause_sigma": 1.0,
                    "document_share": 0.2,
                    "document_tokens": {
                        "mean": 6000,
                        "cv": 0.8,
                        "min_tokens": 1000,
                        "max_tokens": 30000,
                    },
                },
            },
            "docqa": {
                "share": 0.25,
                "set": {
                    "mean_turns": 5.0,
                    "max_turns": 20,
                    "followup_share": 0.6,
                    "followup_median_s": 40.0,
                    "pause_median_s": 600.0,
                    "system_prompt_tokens": 12000,
                    "user_tokens": {"mean": 60, "cv": 0.8, "min_tokens": 4, "max_tokens": 500},
                },
            },
        },
    },
}


_AGENT_TOOLS: dict[str, Any] = {
    "read_file": {
        "share": 0.35,
        "duration_median_s": 0.2,
        "duration_sigma": 0.6,
        "result_tokens": {"mean": 1500, "cv": 0.8, "min_tokens": 50, "max_tokens": 8000},
    },
    "search": {
        "share": 0.15,
        "duration_median_s": 0.5,
        "duration_sigma": 0.6,
        "result_tokens": {"mean": 800, "cv": 0.8, "min_tokens": 50, "max_tokens": 4000},
    },
    "edit_file": {
        "share": 0.25,
        "duration_median_s": 1.0,
        "duration_sigma": 0.5,
        "result_tokens": {"mean": 150, "cv": 0.6, "min_tokens": 20, "max_tokens": 800},
    },
    "web_fetch": {
        "share": 0.1,
        "duration_median_s": 4.0,
        "duration_sigma": 0.6,
        "result_tokens": {"mean": 2500, "cv": 0.6, "min_tokens": 200, "max_tokens": 8000},
    },
    "run_tests": {
        "share": 0.15,
        "duration_median_s": 45.0,
        "duration_sigma": 0.7,
        "result_tokens": {"mean": 1200, "cv": 1.0, "min_tokens": 50, "max_tokens": 8000},
    },
}

PRESETS["agentic"] = {
    "sessions": 240,
    "session_rate": 0.12,
    "arrival_cv": 1.5,
    "mean_turns": 2.0,
    "max_turns": 120,
    "followup_share": 0.2,
    "followup_median_s": 20.0,
    "pause_median_s": 300.0,
    "system_prompt_tokens": 600,
    "tenants": 3,
    "user_tokens": {"mean": 120, "cv": 1.0, "min_tokens": 4, "max_tokens": 2000},
    "answer_tokens": {"mean": 300, "cv": 0.8, "min_tokens": 8, "max_tokens": 2048},
    "max_history_tokens": 110000,  # with the system prompt, a result and a reply: < 128K
    "classes": {
        "agent": {
            "share": 0.5,
            "set": {
                "system_prompt_tokens": 6000,
                "user_tokens": {"mean": 300, "cv": 1.0, "min_tokens": 16, "max_tokens": 4000},
                "answer_tokens": {"mean": 120, "cv": 0.8, "min_tokens": 16, "max_tokens": 1024},
                "tools": _AGENT_TOOLS,
                "tool_call_share": 0.96,
            },
        },
        "chat": {
            "share": 0.5,
            "set": {
                "mean_turns": 2.5,
                "max_turns": 20,
                "followup_share": 0.15,
                "pause_median_s": 180.0,
                "pause_sigma": 1.0,
                "document_share": 0.2,
                "document_tokens": {
                    "mean": 6000,
                    "cv": 0.8,
                    "min_tokens": 1000,
                    "max_tokens": 30000,
                },
            },
        },
    },
}
PRESETS["agentic-hints"] = {**PRESETS["agentic"], "hints": True}


def preset_config(name: str, **overrides: Any) -> GeneratorConfig:
    """A preset, with any field replaced (e.g. `sessions=1000`)."""
    if name not in PRESETS:
        raise KvtierError(f"unknown workload preset {name!r}; choose one of {', '.join(PRESETS)}")
    return GeneratorConfig.from_dict({**PRESETS[name], **overrides})
