"""Present a Plan three ways: rich tables for people, a JSON dict for programs, and one
plain-language verdict line per context length.

JSON schema `kvtier.plan/1` (sizes in bytes, times in seconds, rates in bytes/s or FLOP/s):

    schema, model {name, source, attention, num_layers, num_sliding_layers, sliding_window,
      num_attention_heads, num_kv_heads, head_dim, hidden_size, kv_lora_rank,
      qk_rope_head_dim, num_parameters, num_active_parameters, max_position_embeddings,
      assumed [what was not given and is assumed]},
    kv_dtype, group_size, kv_bytes_per_element, bytes_per_token,
    weight_dtype, weight_bytes, weight_dtype_that_fits (null unless the weights do not fit),
    hardware {key, name, peak_flops, memory_bytes, memory_bandwidth},
    gpus, efficiency, device_bytes, device_free_bytes, tier_bytes (null without --tier-size),
    contexts [{tokens, kv_bytes, average_bytes_per_token, device_fit, tier_fit,
      recompute_flops, recompute_seconds,
      loads [{link, name, bandwidth, seconds, beats_recompute}], verdict}]
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from kvtier.plan.planner import ContextPlan, Plan, weight_bytes
from kvtier.units import format_bytes, format_count, format_gib, format_seconds

SCHEMA = "kvtier.plan/1"


def _both(nbytes: float) -> str:
    return f"{format_bytes(nbytes)} ({format_gib(nbytes)})"


def _machine(plan: Plan) -> str:
    return f"{plan.gpus}x {plan.accelerator.name}"


def verdict(plan: Plan, ctx: ContextPlan) -> str:
    """One sentence a person can act on: size, what fits, and reload vs recompute."""
    g = plan.geometry
    beyond = ""
    if g.max_position_embeddings and ctx.tokens > g.max_position_embeddings:
        beyond = f" (beyond its {g.max_position_embeddings:,}-token limit)"
    head = (
        f"{g.name} at {ctx.tokens:,} tokens{beyond}: {format_bytes(ctx.kv_bytes)} KV "
        f"({format_gib(ctx.kv_bytes)}) per sequence in {plan.kv_dtype.name}"
    )
    if plan.weight_bytes >= plan.device_bytes:
        fit = (
            f"the {format_bytes(plan.weight_bytes)} of weights alone exceed {_machine(plan)} "
            f"({format_bytes(plan.device_bytes)})"
        )
        smaller = plan.weight_dtype_that_fits
        if smaller is not None:
            fit += (
                f", in {smaller.name} (--weight-dtype {smaller.name}) they take "
                f"{format_bytes(weight_bytes(g, smaller))} and fit"
            )
    else:
        verb = "fits" if ctx.device_fit == 1 else "fit"
        fit = (
            f"{ctx.device_fit:,} {verb} on {_machine(plan)} after "
            f"{format_bytes(plan.weight_bytes)} of weights"
        )
    if ctx.tier_fit is not None:
        fit += f", {ctx.tier_fit:,} in the {format_bytes(plan.tier_bytes)} tier"

    best = ctx.fastest_load
    recompute = format_seconds(ctx.recompute_seconds)
    wins = sum(load.beats_recompute for load in ctx.loads)
    share = f"all {wins}" if wins == len(ctx.loads) else f"{wins} of {len(ctx.loads)}"
    if best.beats_recompute:
        restore = (
            f"reloading over {best.link.name} ({format_seconds(best.seconds)}) beats "
            f"recompute ({recompute}); {share} links are faster than recompute"
        )
    else:
        restore = (
            f"recompute ({recompute}) beats reloading over every link "
            f"(fastest: {best.link.name}, {format_seconds(best.seconds)})"
        )
    return f"{head}; {fit}; {restore}."


def to_json(plan: Plan) -> dict[str, Any]:
    g, hw = plan.geometry, plan.accelerator
    return {
        "schema": SCHEMA,
        "model": {
            "name": g.name,
            "source": g.source,
            "attention": g.attention,
            "num_layers": g.num_layers,
            "num_sliding_layers": g.num_sliding_layers,
            "sliding_window": g.sliding_window,
            "num_attention_heads": g.num_attention_heads,
            "num_kv_heads": g.num_kv_heads,
            "head_dim": g.head_dim,
            "hidden_size": g.hidden_size,
            "kv_lora_rank": g.kv_lora_rank,
            "qk_rope_head_dim": g.qk_rope_head_dim,
            "num_parameters": g.num_parameters,
            "num_active_parameters": g.num_active_parameters,
            "max_position_embeddings": g.max_position_embeddings,
            "assumed": list(g.assumed),
        },
        "kv_dtype": plan.kv_dtype.name,
        "group_size": plan.group_size,
        "kv_bytes_per_element": float(plan.kv_dtype.bytes_per_element(plan.group_size)),
        "bytes_per_token": plan.bytes_per_token,
        "weight_dtype": plan.weight_dtype.name,
        "weight_bytes": plan.weight_bytes,
        "weight_dtype_that_fits": (
            plan.weight_dtype_that_fits.name if plan.weight_dtype_that_fits else None
        ),
        "hardware": {
            "key": hw.key,
            "name": hw.name,
            "peak_flops": hw.peak_flops,
            "memory_bytes": hw.memory_bytes,
            "memory_bandwidth": hw.memory_bandwidth,
        },
        "gpus": plan.gpus,
        "efficiency": plan.efficiency,
        "device_bytes": plan.device_bytes,
        "device_free_bytes": plan.device_free_bytes,
        "tier_bytes": plan.tier_bytes,
        "contexts": [
            {
                "tokens": ctx.tokens,
                "kv_bytes": ctx.kv_bytes,
                "average_bytes_per_token": ctx.average_bytes_per_token,
                "device_fit": ctx.device_fit,
                "tier_fit": ctx.tier_fit,
                "recompute_flops": ctx.recompute_flops,
                "recompute_seconds": ctx.recompute_seconds,
                "loads": [
                    {
                        "link": load.link.key,
                        "name": load.link.name,
                        "bandwidth": load.link.bandwidth,
                        "seconds": load.seconds,
                        "beats_recompute": load.beats_recompute,
                    }
                    for load in ctx.loads
                ],
                "verdict": verdict(plan, ctx),
            }
            for ctx in plan.contexts
        ],
    }


def _describe_model(plan: Plan) -> str:
    g = plan.geometry
    if g.kv_lora_rank:
        kv = f"MLA latent {g.kv_lora_rank} + RoPE key {g.qk_rope_head_dim}"
    else:
        heads = f"{g.num_attention_heads} query / {g.num_kv_heads} KV heads"
        kv = f"{g.attention}, {heads} x {g.head_dim}"
    if g.num_sliding_layers:
        kv += f", {g.num_sliding_layers} of {g.num_layers} layers slide over "
        kv += f"{g.sliding_window:,} tokens"
    params = f"{format_count(g.num_parameters)} parameters"
    if g.num_active_parameters != g.num_parameters:
        params += f", {format_count(g.num_active_parameters)} active per token"
    return f"{g.name} ({g.source}): {g.num_layers} layers, {kv}; {params}"


def _memory_table(plan: Plan) -> Table:
    table = Table(title="KV cache per sequence", title_justify="left")
    table.add_column("tokens", justify="right")
    table.add_column("KV", justify="right")
    table.add_column("KV GiB", justify="right")
    table.add_column("avg B/token", justify="right")
    table.add_column("on device", justify="right")
    if plan.tier_bytes is not None:
        table.add_column(f"in {format_bytes(plan.tier_bytes)} tier", justify="right")
    for ctx in plan.contexts:
        row = [
            f"{ctx.tokens:,}",
            format_bytes(ctx.kv_bytes),
            format_gib(ctx.kv_bytes),
            f"{ctx.average_bytes_per_token:,.0f}",
            f"{ctx.device_fit:,}",
        ]
        if ctx.tier_fit is not None:
            row.append(f"{ctx.tier_fit:,}")
        table.add_row(*row)
    return table


def _restore_table(plan: Plan) -> Table:
    table = Table(title="Restore one sequence (* beats recompute)", title_justify="left")
    table.add_column("way")
    for ctx in plan.contexts:
        table.add_column(f"{ctx.tokens:,}", justify="right")
    table.add_row(
        f"recompute, {_machine(plan)} at {plan.efficiency:.0%}",
        *(format_seconds(ctx.recompute_seconds) for ctx in plan.contexts),
    )
    for i, load in enumerate(plan.contexts[0].loads):
        cells = []
        for ctx in plan.contexts:
            cell = ctx.loads[i]
            cells.append(format_seconds(cell.seconds) + (" *" if cell.beats_recompute else "  "))
        table.add_row(f"{load.link.name} ({load.link.bandwidth / 1e9:g} GB/s)", *cells)
    return table


def print_report(plan: Plan, console: Console | None = None) -> None:
    console = console or Console(highlight=False)
    bpe = plan.kv_dtype.bytes_per_element(plan.group_size)
    per_token = f"{plan.bytes_per_token:,.0f} B/token"
    if plan.geometry.num_sliding_layers:
        per_token += " once the windows are full"
    console.print(_describe_model(plan), markup=False, soft_wrap=True)
    for note in plan.geometry.assumed:
        console.print(f"Assumed: {note}.", markup=False, soft_wrap=True)
    console.print(
        f"KV in {plan.kv_dtype.name} ({float(bpe):g} B/element): {per_token}. "
        f"Weights in {plan.weight_dtype.name}: {_both(plan.weight_bytes)} on {_machine(plan)} "
        f"({format_bytes(plan.device_bytes)}), {_both(plan.device_free_bytes)} left for KV.",
        markup=False,
        soft_wrap=True,
    )
    console.print(_memory_table(plan))
    console.print(_restore_table(plan))
    for ctx in plan.contexts:
        console.print(verdict(plan, ctx), markup=False, soft_wrap=True)
