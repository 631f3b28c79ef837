"""The quality study's table: held-out NLL / PPL per policy before QAT, after QAT, after QAD and for the control,
the degradation recovered, the spread over seeds, the time per step, and what is inside the noise.

Definitions (docs/qat-study.md repeats them):
- every NLL is in nats per byte on the held-out windows; PPL = exp(NLL). A decode-phase policy is scored on the
  decode suffix of each window, and so are the numbers it is compared with (exact, control);
- a seed chooses the fine-tuning batches; QAT, QAD and the control of one seed see the same batches;
- control: the pretrained model trained on with exact numerics for the same steps, then evaluated under the
  policy (the model that served without QAT) and under exact numerics (what the extra steps alone give);
- recovered = 100 x (control under the policy - QAT) / (control under the policy - control exact), per seed;
- a difference between two models is paired over the same held-out windows; its uncertainty sigma combines the
  windows' standard error and the seed-to-seed variance, and a difference is inside the noise when
  |mean| <= 2 sigma;
- by position: the same differences over each span of the scored positions (the windows' NLL on that span), so
  that an error which accumulates along the decode suffix shows as a difference growing with the position.
"""
from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class Difference:
    mean: float
    sigma: float

    @property
    def inside_noise(self) -> bool:
        return abs(self.mean) <= 2 * self.sigma

    def text(self) -> str:
        return f"{self.mean:+.4f} ± {2 * self.sigma:.4f}"


def paired(a: list[float], b: list[float]) -> tuple[float, float]:
    """Mean of a - b over paired windows, and its standard error."""
    if len(a) != len(b) or not a:
        raise ValueError(f"paired comparison of {len(a)} and {len(b)} windows")
    d = [x - y for x, y in zip(a, b)]
    mean = sum(d) / len(d)
    var = sum((x - mean) ** 2 for x in d) / max(1, len(d) - 1)
    return mean, math.sqrt(var / len(d))


def combine(per_seed: list[tuple[float, float]]) -> Difference:
    """One difference from per-seed (mean, standard error) pairs: the seeds' mean, with sigma^2 = the mean
    squared standard error / S + the seeds' variance / S."""
    means = [m for m, _ in per_seed]
    S = len(means)
    mean = sum(means) / S
    seed_var = sum((m - mean) ** 2 for m in means) / (S - 1) if S > 1 else 0.0
    return Difference(mean, math.sqrt(sum(se ** 2 for _, se in per_seed) / S / S + seed_var / S))


def spread(values: list[float]) -> float:
    return (max(values) - min(values)) / 2 if values else float("nan")


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


class Evals:
    """Lookup over the study's evaluation records."""

    def __init__(self, records: list[dict]):
        self.records = records

    def find(self, model: str, under: str, scoring: str, seed=None, trained_under=None) -> dict | None:
        for r in self.records:
            if (r["model"], r["under"], r["scoring"], r.get("seed"), r.get("trained_under")) == (
                    model, under, scoring, seed, trained_under):
                return r
        return None

    def seeds(self, model: str, under: str, scoring: str, seeds, trained_under=None) -> dict[int, dict]:
        found = {s: self.find(model, under, scoring, s, trained_under) for s in seeds}
        return {s: r for s, r in found.items() if r is not None}


@dataclasses.dataclass
class Row:
    policy: str
    scoring: str
    exact: dict
    before: dict | None
    control: dict[int, dict]  # seed -> the control evaluated under the policy
    control_exact: dict[int, dict]  # seed -> the control under exact numerics
    qat: dict[int, dict]
    qad: dict[int, dict]
    ms_qat: list[float]
    ms_qad: list[float]

    def gap(self) -> Difference | None:
        """What the policy costs the pretrained model (no QAT - exact)."""
        return None if self.before is None else Difference(*paired(self.before["per_sequence"],
                                                                   self.exact["per_sequence"]))

    def versus_control(self, trained: dict[int, dict]) -> Difference | None:
        seeds = sorted(set(trained) & set(self.control))
        if not seeds:
            return None
        return combine([paired(trained[s]["per_sequence"], self.control[s]["per_sequence"]) for s in seeds])

    def control_gap(self) -> Difference | None:
        seeds = sorted(set(self.control) & set(self.control_exact))
        if not seeds:
            return None
        return combine([paired(self.control[s]["per_sequence"], self.control_exact[s]["per_sequence"])
                        for s in seeds])

    def recovered(self, trained: dict[int, dict]) -> list[float]:
        out = []
        for s in sorted(set(trained) & set(self.control) & set(self.control_exact)):
            denominator = self.control[s]["nll"] - self.control_exact[s]["nll"]
            if denominator != 0:
                out.append(100 * (self.control[s]["nll"] - trained[s]["nll"]) / denominator)
        return out


def rows(results: dict) -> list[Row]:
    evals = Evals(results["evals"])
    seeds = results["config"]["seeds"]
    out = []
    for policy in results["config"]["policies"]:
        scoring = "suffix" if policy in results["decode_policies"] else "full"
        runs = [r for r in results["runs"] if r["policy"] == policy]
        out.append(Row(
            policy, scoring,
            exact=evals.find("pretrained", "exact", scoring),
            before=evals.find("pretrained", policy, scoring),
            control=evals.seeds("control", policy, scoring, seeds, "exact"),
            control_exact=evals.seeds("control", "exact", scoring, seeds, "exact"),
            qat=evals.seeds("qat", policy, scoring, seeds, policy),
            qad=evals.seeds("qad", policy, scoring, seeds, policy),
            ms_qat=[1e3 * r["seconds_per_step"] for r in runs if r["mode"] == "qat"],
            ms_qad=[1e3 * r["seconds_per_step"] for r in runs if r["mode"] == "qad"]))
    return out


def _cell(records: dict[int, dict] | dict | None) -> str:
    if not records:
        return "not run"
    if "nll" in records:  # one record
        return f"{records['nll']:.4f} ({records['ppl']:.3f})"
    nlls = [r["nll"] for r in records.values()]
    text = f"{mean(nlls):.4f} ± {spread(nlls):.4f} ({math.exp(mean(nlls)):.3f})"
    return text if len(nlls) > 1 else text.replace(" ± 0.0000", "")


def _percent(values: list[float], gap: Difference | None) -> str:
    if not values:
        return "not run"
    if gap is not None and gap.inside_noise:
        return "— (gap inside the noise)"
    return f"{mean(values):.0f} % ± {spread(values):.0f}"


def _ms(values: list[float]) -> str:
    return f"{mean(values):.1f}" if values else "—"


HEADER = ("| policy | scored | exact | no QAT | control | after QAT | after QAD | recovered by QAT "
          "| recovered by QAD | ms/step QAT | ms/step QAD |")


def table(results: dict) -> str:
    lines = [HEADER, "|" + "---|" * (HEADER.count("|") - 1)]
    for row in rows(results):
        gap = row.control_gap()
        cells = [row.policy, row.scoring, _cell(row.exact), _cell(row.before), _cell(row.control), _cell(row.qat),
                 _cell(row.qad), _percent(row.recovered(row.qat), gap), _percent(row.recovered(row.qad), gap),
                 _ms(row.ms_qat), _ms(row.ms_qad)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _verdict(diff: Difference | None, what: str) -> str | None:
    if diff is None:
        return None
    where = "inside the noise" if diff.inside_noise else "beyond the noise"
    return f"{what} {diff.text()} nats: {where}"


def noise_statements(results: dict) -> list[str]:
    """One plain line per policy: which of its differences are inside the noise (|mean| <= 2 sigma)."""
    lines = []
    for row in rows(results):
        parts = [_verdict(row.gap(), "no QAT - exact"),
                 _verdict(row.control_gap(), "control under the policy - control exact"),
                 _verdict(row.versus_control(row.qat), "QAT - control"),
                 _verdict(row.versus_control(row.qad), "QAD - control")]
        if row.qat and row.qad:
            seeds = sorted(set(row.qat) & set(row.qad))
            parts.append(_verdict(combine([paired(row.qad[s]["per_sequence"], row.qat[s]["per_sequence"])
                                           for s in seeds]), "QAD - QAT"))
        lines.append(f"- **{row.policy}**: " + "; ".join(p for p in parts if p) + ".")
    return lines


def _span(record: dict, j: int) -> list[float]:
    return [window[j] for window in record["per_span"]]


def span_differences(row: Row) -> dict[str, list[Difference]]:
    """Per comparison, one difference per position span (empty where the records have no spans)."""
    spans = range(len((row.exact or {}).get("span_starts") or []))
    out: dict[str, list[Difference]] = {}
    if not spans:
        return out
    if row.before is not None and row.before.get("per_span"):
        out["no QAT - exact"] = [Difference(*paired(_span(row.before, j), _span(row.exact, j))) for j in spans]
    for name, trained, base in (("control under the policy - control exact", row.control, row.control_exact),
                                ("QAT - control", row.qat, row.control), ("QAD - control", row.qad, row.control)):
        seeds = sorted(s for s in set(trained) & set(base) if trained[s].get("per_span") and base[s].get("per_span"))
        if seeds:
            out[name] = [combine([paired(_span(trained[s], j), _span(base[s], j)) for s in seeds]) for j in spans]
    return out


def span_table(results: dict) -> str:
    """Differences by position span of the scored window (decode-phase policies: along the suffix)."""
    lines = []
    for row in rows(results):
        diffs = span_differences(row)
        if not diffs:
            continue
        starts = row.exact["span_starts"]
        if not lines:
            head = "| policy | difference | " + " | ".join(f"from {s}" for s in starts) + " |"
            lines += [head, "|" + "---|" * (head.count("|") - 1)]
        for name, values in diffs.items():
            cells = [(d.text() + ("" if d.inside_noise else " *")) for d in values]
            lines.append(f"| {row.policy} | {name} | " + " | ".join(cells) + " |")
    if not lines:
        return ""
    return "\n".join(["By position (mean ± 2 sigma, nats per byte; * beyond the noise):", "", *lines])


def markdown(results: dict) -> str:
    spans = span_table(results)
    return "\n".join([table(results), "", "Differences (mean ± 2 sigma, nats per byte):", "",
                      *noise_statements(results), *(["", spans] if spans else [])])


def _key(record: dict) -> tuple:
    return (record["model"], record["under"], record["scoring"], record.get("seed"), record.get("trained_under"))


def merge(first: dict, *others: dict) -> dict:
    """Study results of several commands that fine-tuned the same pretrained weights (the same checkpoint) as one:
    policies, seeds and modes are the union; an evaluation or run that an earlier result already holds is kept from
    the earlier one (a later command's repeat of the control of a seed is dropped); ``merged_from`` lists each
    command's line and the records it contributed. The inputs are not modified."""
    def contribution(results: dict, evals: list, runs: list) -> dict:
        return {"command": results.get("command"), "seconds": results.get("seconds"), "evals": len(evals),
                "runs": len(runs)}

    merged = {**first, "evals": list(first["evals"]), "runs": list(first["runs"]), "skipped": list(first["skipped"]),
              "decode_policies": list(first["decode_policies"]),
              "config": {**first["config"], **{k: list(first["config"][k]) for k in ("policies", "modes", "seeds")}},
              "merged_from": [contribution(first, first["evals"], first["runs"])]}
    for results in others:
        if results["corpus"]["fingerprint"] != first["corpus"]["fingerprint"] or (
                results.get("pretrain") or {}).get("steps") != (first.get("pretrain") or {}).get("steps"):
            raise ValueError(f"{results.get('command')!r}: another corpus or pretrained model than the first result's")
        seen = {_key(e) for e in merged["evals"]}
        ran = {(r["policy"], r["mode"], r["seed"]) for r in merged["runs"]}
        evals = [e for e in results["evals"] if _key(e) not in seen]
        runs = [r for r in results["runs"] if (r["policy"], r["mode"], r["seed"]) not in ran]
        merged["evals"] += evals
        merged["runs"] += runs
        for key in ("policies", "modes", "seeds"):
            merged["config"][key] += [x for x in results["config"][key] if x not in merged["config"][key]]
        merged["decode_policies"] += [p for p in results["decode_policies"] if p not in merged["decode_policies"]]
        merged["skipped"] += results["skipped"]
        merged["merged_from"].append(contribution(results, evals, runs))
    merged["seconds"] = sum(r.get("seconds") or 0 for r in (first, *others))
    # a skipped run that a later command ran is not skipped
    done = {f"{r['policy']}/{r['mode']}/seed{r['seed']}" for r in merged["runs"]}
    merged["skipped"] = [s for s in merged["skipped"] if s["run"] not in done]
    return merged
