"""Tables and targets of ``benchmarks/constrained.py``: markdown for every stage's results, and
the issue's targets checked against them (pure functions of the results dict)."""

from __future__ import annotations


def fmt(x: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "—" if x is None else f"{x:{spec}}{suffix}"


def frac(num: int, den: int) -> str:
    return f"{num}/{den} ({num / den:.1%})" if den else "—"


def corpus_tables(corpus: dict[str, dict]) -> list[str]:
    """Markdown: one summary row per backend, then per-file rows."""
    lines = ["| backend | schemas/file | schemas | compiled (coverage) | end check only | timeouts | compile p50 | "
             "compile p99 | mask p50 | mask p99 | valid accepted | invalid rejected | violations | "
             "violations without end check | mask≠accept |",
             "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for name, s in corpus.items():
        o = s["overall"]
        lines.append(
            f"| {name} | {o['limit_per_file'] or 'all'} | {o['schemas']} | {frac(o['compiled'], o['schemas'])} | "
            f"{o['end_check_schemas']} | {o['timeouts']} | "
            f"{fmt(o['compile_p50_s'] and o['compile_p50_s'] * 1e3, '.1f', ' ms')} | "
            f"{fmt(o['compile_p99_s'], '.2f', ' s')} | {fmt(o['mask_p50_us'], '.0f', ' µs')} | "
            f"{fmt(o['mask_p99_us'], '.0f', ' µs')} | {frac(o['valid_accepted'], o['valid'])} | "
            f"{frac(o['invalid_rejected'], o['invalid'])} | {o['violations']} | {o['raw_violations']} | "
            f"{o['mask_disagreements']} |")
    lines += ["", "| file | backend | schemas | compiled | valid accepted | invalid rejected |",
              "|---|---|--:|--:|--:|--:|"]
    files = sorted({f for s in corpus.values() for f in s["per_file"]})
    for f in files:
        for name, s in corpus.items():
            p = s["per_file"].get(f)
            if p:
                lines.append(f"| {f} | {name} | {p['schemas']} | {frac(p['compiled'], p['schemas'])} | "
                             f"{frac(p['valid_accepted'], p['valid'])} | {frac(p['invalid_rejected'], p['invalid'])} |")
    return lines


def targets(res: dict) -> list[dict]:
    """The issue's performance targets, where the stages that measure them ran."""
    rows = []

    def add(target: str, value: float | None, met: bool | None) -> None:
        if value is not None:
            rows.append({"target": target, "value": value, "met": bool(met)})

    default = res["config"].get("default_backend", "llguidance")
    d = res["corpus"].get(default, {}).get("overall")
    if d:
        whole = " (whole corpus)" if not d["limit_per_file"] else f" ({d['limit_per_file']} per file)"
        add(f"corpus: {default} (default) coverage >= 97%{whole}", d["compile_rate"], (d["compile_rate"] or 0) >= 0.97)
        add(f"corpus: {default} (default) violations = 0{whole}", d["violations"], d["violations"] == 0)
    gen = res["generation"].get(default)
    if gen:
        add(f"generation: {default} (default) violations = 0", gen["invalid"], gen["invalid"] == 0)
    for mode, runs in res["speed"].items():
        label = "default" if mode == "jump-forward on" else "mask cost alone"
        for bs, r in runs.items():
            if int(bs) > 1:
                add(f"speed: JSON / unconstrained tok/s at batch {bs} >= 0.95x ({mode}: {label})", r["ratio"],
                    r["ratio"] >= 0.95)
    on, off = res["jump"].get("on"), res["jump"].get("off")
    if on and off:
        r = off["forward_passes"] / max(on["forward_passes"], 1)
        add("jump-forward: forward passes off / on >= 1.3x", r, r >= 1.3)
        w = off["wall_s"] / on["wall_s"]
        add("jump-forward: wall time off / on > 1x (lower wall time)", w, w > 1.0)
    return rows


def markdown(res: dict) -> str:
    lines: list[str] = []
    if res["corpus"]:
        lines += ["### Schema corpus", "", *corpus_tables(res["corpus"]), ""]
    if res["generation"]:
        lines += ["### Generation compliance (greedy, jsonschema-validated)", "",
                  "| backend | schemas | compliant | length-cut | compliant when not cut | violations | aborted "
                  "(dead ends) | mean tokens |", "|---|--:|--:|--:|--:|--:|--:|--:|"]
        for name, g in res["generation"].items():
            lines.append(f"| {name} | {g['schemas']} | {frac(g['compliant'], g['schemas'])} | {g['length_cut']} | "
                         f"{frac(g['compliant'], g['schemas'] - g['length_cut'])} | {g['invalid']} | "
                         f"{g['aborted']} ({g.get('dead_ends', 0)}) | {fmt(g['mean_tokens'], '.1f')} |")
        lines.append("")
    if res["speed"]:
        lines += ["### Speed: JSON-constrained vs unconstrained (same prompts, same token counts per request)", "",
                  "| engine | batch | run | requests | output tok | jump-forward tok | forward passes | wall (s) | "
                  "grammar (s) | sample (s) | tok/s | JSON / plain |", "|---|--:|---|" + "--:|" * 9]
        for mode, runs in res["speed"].items():
            for bs, pair in runs.items():
                for kind in ("json", "plain"):
                    r = pair[kind]
                    ratio = fmt(pair["ratio"], ".2f", "x") if kind == "json" else ""
                    lines.append(f"| {mode} | {bs} | {kind} | {r['requests']} | {r['output_tokens']} | "
                                 f"{r['jump_forward_tokens']} | {r['forward_passes']} | {r['wall_s']:.1f} | "
                                 f"{r['grammar_s']:.2f} | {r['sample_s']:.2f} | {r['tok_s']:.1f} | {ratio} |")
        lines.append("")
    if res["jump"]:
        lines += ["### Jump-forward on vs off (JSON extraction, one batch)", "",
                  "| jump-forward | requests | output tok | jump-forward tok | forward passes | wall (s) | "
                  "grammar (s) | valid |", "|---|--:|--:|--:|--:|--:|--:|--:|"]
        for mode, r in res["jump"].items():
            lines.append(f"| {mode} | {r['requests']} | {r['output_tokens']} | {r['jump_forward_tokens']} | "
                         f"{r['forward_passes']} | {r['wall_s']:.1f} | {r['grammar_s']:.2f} | "
                         f"{r['valid']}/{r['requests']} |")
        on, off = res["jump"].get("on"), res["jump"].get("off")
        if on and off:
            lines.append(f"| off / on | | {off['output_tokens'] / on['output_tokens']:.2f}x | | "
                         f"{off['forward_passes'] / max(on['forward_passes'], 1):.2f}x | "
                         f"{off['wall_s'] / on['wall_s']:.2f}x | | |")
        lines.append("")
    if res["targets"]:
        lines += ["### Targets", "", "| target | measured | met |", "|---|--:|:-:|"]
        for t in res["targets"]:
            value = (fmt(t["value"], ".1%") if "%" in t["target"] else str(t["value"]) if "violations" in t["target"]
                     else fmt(t["value"], ".2f", "x"))
            lines.append(f"| {t['target']} | {value} | {'yes' if t['met'] else 'no'} |")
    return "\n".join(lines)
