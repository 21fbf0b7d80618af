"""The measurement campaign (``conf/campaign.yaml``) expanded into the cells ``runners.run`` writes.

    items = load_campaign()                  # list[CampaignItem], checked
    cells = expand(items[0])                 # list[PlannedCell]: one per sweep point

An item names a sweep preset and the overrides it runs with; ``expand`` takes the preset's sweeper
params x the item's overrides as Hydra's basic sweeper does (``runners.run.sweep_jobs``), composes
each cell (``runners.run._compose_cached``, ``resolve``) and names its folder as the runner does
(``<sweep_name>/<cell_id>``). ``analysis.coverage`` compares the plan with ``results/raw``;
``python -m analysis.coverage`` prints what each item still misses and the command that runs it.
"""
from __future__ import annotations

import re
import shlex
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import yaml

from granikv.rawio import applicable_table, flatten

CONF = Path(__file__).resolve().parents[1] / "conf"
CAMPAIGN_YAML = CONF / "campaign.yaml"
GPU_COUNTS = (1, 2, 4, 8)
# config keys that say WHICH cell a raw folder is (two cells that agree on these and on the
# item's overrides are the same point of the plan); every other key is a setting, compared to today's
IDENTITY = ("system.name", "model.name", "tp", "rep", "profile_steps", "hardware.name", "workload.kind",
            "workload.prefix_len", "workload.batch", "workload.num_prefixes", "workload.prefix_lens")
# keys that never change a measurement (runners.run.EXCLUDED_KEYS, as config columns)
NOT_SETTINGS = ("results_dir", "force", "nvml", "nsys", "sweep_name")


def _presets() -> list[str]:
    return sorted(p.stem for p in (CONF / "sweep").glob("*.yaml"))


@dataclass
class CampaignItem:
    """One sweep of the campaign: ``python -m runners.run -m sweep=<sweep> <overrides>`` on ``gpus``
    GPUs of one host (``gpus`` = the cells' tp). ``what`` names the paper table or claim it feeds."""

    id: str
    what: str
    issue: int
    sweep: str
    overrides: list[str] = field(default_factory=list)
    gpus: int = 1
    # sweep folders (results/raw/<name>) whose cells this item's cells replace, configuration by
    # configuration (analysis.clean.prefer_rerun sets the older ones aside; they stay in results/raw)
    supersedes: list[str] = field(default_factory=list)

    def __post_init__(self):
        where = f"conf/campaign.yaml item `{self.id}`"
        if not isinstance(self.supersedes, list) or not all(isinstance(s, str) and re.fullmatch(r"[A-Za-z0-9_.]+", s)
                                                             for s in self.supersedes):
            raise ValueError(f"{where}: supersedes must be a list of sweep folder names (results/raw/<name>), "
                             f"got {self.supersedes!r}")
        if not isinstance(self.id, str) or not re.fullmatch(r"[a-z0-9_]+", self.id):
            raise ValueError(f"conf/campaign.yaml: item id {self.id!r} must be lower-case letters, digits and _")
        if self.sweep not in _presets():
            raise ValueError(f"{where}: sweep `{self.sweep}` is not a preset in conf/sweep/ ({', '.join(_presets())})")
        if not isinstance(self.overrides, list) or not all(isinstance(o, str) and "=" in o for o in self.overrides):
            raise ValueError(f"{where}: overrides must be a list of Hydra overrides `key=value`, got {self.overrides!r}")
        if any(o.split("=", 1)[0].lstrip("+~") in ("sweep", "sweep_name", "results_dir") for o in self.overrides):
            raise ValueError(f"{where}: overrides must not set sweep, sweep_name or results_dir "
                             "(the item's `sweep` field names the preset; the folder follows from it)")
        if self.gpus not in GPU_COUNTS:
            raise ValueError(f"{where}: gpus={self.gpus!r}, must be one of {GPU_COUNTS} (the cells' tp)")
        if not isinstance(self.issue, int) or self.issue < 1:
            raise ValueError(f"{where}: issue must be the number of the issue that asks for the sweep")

    def device_command(self, overrides: list[str] | None = None) -> str:
        """The GPU-host command (runners/gpu/sweep.sh, resumable) for this item, or for ``overrides``
        in place of the item's own (e.g. the axes restricted to what is missing)."""
        ov = self.overrides if overrides is None else overrides
        tp = f"GRANIKV_TP={self.gpus} " if self.gpus > 1 else ""
        # cells served by real SGLang (system=sglang_server*) take sweep.sh's SGLang setup, not the engine's
        systems = [o.split("=", 1)[1] for o in self.overrides if o.startswith("system=")]
        systems = systems or [str(sweep_params(self.sweep).get("system", ""))]
        engine = "GRANIKV_ENGINE=sglang " if any("sglang_server" in s for s in systems) else ""
        tail = f" -- {' '.join(shlex.quote(o) for o in ov)}" if ov else ""
        return f"{tp}{engine}bash runners/gpu/sweep.sh {self.sweep}{tail}"

    def local_command(self, overrides: list[str] | None = None) -> str:
        """The same sweep on a machine of your own (torchrun at tp > 1)."""
        ov = self.overrides if overrides is None else overrides
        launch = (f"torchrun --standalone --nproc_per_node={self.gpus} -m runners.run" if self.gpus > 1
                  else "python -m runners.run")
        return f"{launch} -m sweep={self.sweep}" + "".join(f" {shlex.quote(o)}" for o in ov)


@dataclass(frozen=True)
class PlannedCell:
    """One cell of an item's plan: its overrides (as the sweeper launches them), folder, the
    config values that identify it, and every setting of its composed config (flattened, dotted)."""

    item: str
    overrides: tuple[str, ...]          # sweeper axes + item overrides, incl. sweep=<preset>
    sweep_name: str
    cell_id: str
    identity: dict                      # IDENTITY keys + the keys the overrides set -> value
    settings: dict                      # every flattened config key (no NOT_SETTINGS) -> value


def load_campaign(path: str | Path = CAMPAIGN_YAML) -> list[CampaignItem]:
    """conf/campaign.yaml -> checked items (unique ids, known presets, GPU counts)."""
    path = Path(path)
    doc = yaml.safe_load(path.read_text())
    if not isinstance(doc, dict) or not isinstance(doc.get("items"), list):
        raise ValueError(f"{path}: needs a top-level `items:` list (see the comment at its top)")
    items = []
    for i, raw in enumerate(doc["items"]):
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: items[{i}] must be a mapping with id, what, issue, sweep[, overrides, gpus, "
                             "supersedes]")
        unknown = set(raw) - {"id", "what", "issue", "sweep", "overrides", "gpus", "supersedes"}
        missing = {"id", "what", "issue", "sweep"} - set(raw)
        if unknown or missing:
            raise ValueError(f"{path}: items[{i}] ({raw.get('id', '?')}): "
                             + (f"unknown keys {sorted(unknown)}" if unknown else f"missing keys {sorted(missing)}"))
        items.append(CampaignItem(**{**raw, "overrides": list(raw.get("overrides") or []),
                                     "supersedes": list(raw.get("supersedes") or [])}))
    ids = [it.id for it in items]
    if dup := sorted({i for i in ids if ids.count(i) > 1}):
        raise ValueError(f"{path}: item ids must be unique, repeated: {dup}")
    return items


def load_benches(path: str | Path = CAMPAIGN_YAML) -> dict[str, str]:
    """conf/campaign.yaml ``benches``: results/raw folder -> the runner that writes it (folders of the
    benches outside the runners.run sweeps), checked."""
    path = Path(path)
    doc = yaml.safe_load(path.read_text()) or {}
    out: dict[str, str] = {}
    for i, raw in enumerate(doc.get("benches") or []):
        if not isinstance(raw, dict) or set(raw) != {"folder", "what"} or not isinstance(raw["folder"], str) \
                or not re.fullmatch(r"[A-Za-z0-9_.-]+", raw["folder"]):
            raise ValueError(f"{path}: benches[{i}] must be a mapping {{folder: <results/raw folder name>, what: "
                             f"<the runner that writes it>}}, got {raw!r}")
        if raw["folder"] in out:
            raise ValueError(f"{path}: benches[{i}]: folder `{raw['folder']}` is listed twice")
        out[raw["folder"]] = str(raw["what"])
    return out


def sweep_params(sweep: str) -> dict:
    """The sweeper params of conf/sweep/<sweep>.yaml as written (``{"system": "a,b", ...}``), read without a
    composition."""
    doc = yaml.safe_load((CONF / "sweep" / f"{sweep}.yaml").read_text()) or {}
    return ((doc.get("hydra") or {}).get("sweeper") or {}).get("params") or {}


def named_folders(path: str | Path = CAMPAIGN_YAML) -> set[str]:
    """Every results/raw folder the campaign names: each item's sweep folder (as ``expand`` names it), the
    folders items supersede, and the benches'. The analysis reads only these (analysis.load ``folders``)."""
    out = set(load_benches(path))
    for item in load_campaign(path):
        out |= {c.sweep_name for c in expand(item)} | set(item.supersedes)
    return out


def _key_column(override: str) -> str:
    """``system=granikv`` -> ``system.name`` (a group choice names its option); ``a.b=1`` -> ``a.b``."""
    key = override.split("=", 1)[0].lstrip("+~")
    return key if "." in key or key not in _groups() else f"{key}.name"


def _groups() -> set[str]:
    from runners.run import _GROUPS   # the config groups runners.run composes (conf/ sub-folders)
    return _GROUPS


def _config_dict(job: list[str], compose, check: bool, bases: dict) -> dict:
    """One planned cell -> the dict runners.run stores as its config (``asdict(resolve(cfg))``).

    ``check=True`` composes as the runner does (``_compose_cached``) and runs the dataclasses' checks:
    ~70 ms a cell, most of it OmegaConf copying the hardware's decision table. ``check=False`` takes
    each set of group choices' composition once (from the runner's ``_compose_cached``, which composes
    it once per process), sets the decision table aside, applies the plain ``key=value`` overrides to a
    copy of the rest and puts the table back (no override of the campaign touches it), then applies
    resolve's one change (the concurrency cap) itself: ~5 ms a cell."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    from granikv.config import RunConfig
    from runners.run import _compose_cached, resolve

    parsed = OverridesParser.create().parse_overrides(job)
    groups = [o for o in parsed if "." not in o.key_or_group and o.key_or_group in _groups()]
    values = [o for o in parsed if o not in groups]
    if check or any(o.is_add() or o.is_delete() or o.is_force_add() or o.key_or_group.startswith(
            ("hydra", "hardware.decision_table")) for o in parsed):
        return asdict(resolve(_compose_cached(job, compose)))
    key = tuple(o.input_line for o in groups)
    if key not in bases:
        base = _compose_cached(list(key), compose)   # a copy of the runner's composition of these choices
        table = base.hardware.decision_table
        table = None if table is None else OmegaConf.to_container(table, resolve=True)
        base.hardware.decision_table = None
        bases[key] = (base, table)
    base, table = bases[key]
    cfg = base.copy()
    for o in values:
        OmegaConf.update(cfg, o.key_or_group, o.value(), merge=False)
    names = {f.name for f in fields(RunConfig)}
    d = {k: v for k, v in OmegaConf.to_container(cfg, resolve=True).items() if k in names}
    d["hardware"]["decision_table"] = table
    d["hardware"]["max_running_requests"] = min(d["hardware"]["max_running_requests"], d["workload"]["batch"])
    return d


_PLANS: dict[tuple, list[PlannedCell]] = {}


def expand(item: CampaignItem, check: bool = False, every: int = 1) -> list[PlannedCell]:
    """Every cell ``runners.run -m sweep=<item.sweep> <item.overrides>`` would run, in launch order.
    ``check``: also run every cell's config checks (the dataclasses' ``__post_init__``), as the sweep's
    precheck does; slower (tests/test_campaign.py checks both ways give the same settings). ``every``:
    plan only every ``every``-th cell of the launch order, starting with the first (the test's
    check-mode sample of a large item)."""
    if not isinstance(every, int) or every < 1:
        raise ValueError(f"expand(every={every!r}): must be an int >= 1")
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from runners.run import ConfigError, cell_id, sweep_jobs

    def plan() -> list[PlannedCell]:
        bases: dict = {}
        task = [f"sweep={item.sweep}", *item.overrides]
        if check:   # compose without the item's own sweep axes (plain compose cannot take a, b); sweep_jobs expands them
            from hydra.core.override_parser.overrides_parser import OverridesParser
            from omegaconf import OmegaConf, open_dict
            single = [o.input_line for o in OverridesParser.create().parse_overrides(task) if not o.is_sweep_override()]
            top = compose(config_name="config", overrides=single, return_hydra_config=True)
            OmegaConf.set_readonly(top, False)
            with open_dict(top):
                top.hydra.overrides.task = task
        else:   # the sweeper params come from the preset alone: read them without a composition (~0.2 s)
            from omegaconf import OmegaConf
            params = sweep_params(item.sweep)
            top = OmegaConf.create({"hydra": {"sweeper": {"params": {k: str(v) for k, v in params.items()}},
                                              "overrides": {"task": task}}})
        out = []
        for job in list(sweep_jobs(top))[::every]:
            try:
                d = _config_dict(job, compose, check, bases)
            except ConfigError as e:
                raise ValueError(f"conf/campaign.yaml item `{item.id}`, cell {cell_id(job)}: {e}") from e
            if d["tp"] != item.gpus:
                raise ValueError(f"conf/campaign.yaml item `{item.id}`: gpus={item.gpus} but its cells run at "
                                 f"tp={d['tp']}; set gpus: {d['tp']} (one process per GPU)")
            flat = flatten(applicable_table(d))
            keys = list(IDENTITY) + [_key_column(o) for o in job if not o.startswith("sweep=")]
            out.append(PlannedCell(item=item.id, overrides=tuple(job), sweep_name=d["sweep_name"],
                                   cell_id=cell_id(job), identity={k: flat.get(k) for k in dict.fromkeys(keys)},
                                   settings={k: v for k, v in flat.items() if k not in NOT_SETTINGS}))
        return out

    key = (item.id, item.sweep, tuple(item.overrides), item.gpus, check, every)
    if key not in _PLANS:   # conf/ does not change within a process: expand once
        if GlobalHydra.instance().is_initialized():   # inside a caller's Hydra context (its conf/ is ours)
            _PLANS[key] = plan()
        else:
            with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
                _PLANS[key] = plan()
    return list(_PLANS[key])
