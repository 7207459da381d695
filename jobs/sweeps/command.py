"""``ddpjob sweep``: a grid or random sweep as Slurm job arrays, or an adaptive (Optuna) search; its arguments and
how each kind is dispatched (``jobs.sweeps.arrays`` submits grids, ``jobs.sweeps.search`` searches).

Imports stay light at the top (no torch): ``ddpjob --help`` builds this parser.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from ddp_core.errors import DdpJobError
from jobs.submission import limits

if TYPE_CHECKING:
    from jobs.sweeps.spec import Sweep


def add_parser(sub: Any) -> None:
    """Register ``sweep`` on ``ddpjob``'s subparsers."""
    p = sub.add_parser("sweep", help="submit a hyperparameter sweep as Slurm job arrays (returns at once)")
    p.add_argument(
        "config",
        nargs="?",
        help="a base config (then key=v1,v2 / key=range(a,b) args) or a sweep YAML (optional with --script)",
    )
    p.add_argument("overrides", nargs="*", metavar="key=values", help="grid keys (comma lists, range()) or fixed keys")
    p.add_argument(
        "--script",
        metavar="TRAIN.py",
        help="script mode: every trial runs this script; its fixed arguments go after --, swept ones are "
        "script.args.NAME=v1,v2",
    )
    p.add_argument("--name", help="sweep name (directory under run.root, W&B group)")
    p.add_argument("--trials", type=int, help="random search: number of draws (sweep YAML with random:)")
    p.add_argument("--seed", type=int, help="random search: seed (same seed, same trials)")
    p.add_argument("--dry-run", action="store_true", help="list the trials and print the array script only")
    p.add_argument(
        "--pack",
        nargs="?",
        type=int,
        const=0,
        metavar="N",
        help="grid or random sweep: run the trials side by side in N allocations of whole nodes, one trial per slot "
        "(default N: enough for slurm.array_parallelism trials at once)",
    )
    p.add_argument("--no-snapshot", action="store_true", help="do not copy the code into the sweep (snapshot.enabled)")
    p.add_argument("--no-cluster-check", action="store_true", help="skip checking the request against sinfo")
    p.add_argument(
        "--search",
        metavar="SAMPLER",
        help="adaptive search (Optuna): tpe, random, grid or cmaes; "
        "params as key=loguniform(1e-5,1e-2), key=choice(a,b), key=range(32,257,32)",
    )
    p.add_argument("--parallel", type=int, help="adaptive search: workers (array tasks) at once")
    p.add_argument("--pruner", help="adaptive search: median, asha, hyperband or none")
    p.add_argument("--metric", help="adaptive search: what to optimise (default eval/loss, minimised; max:eval/NAME)")
    p.add_argument("--more", type=int, metavar="N", help="adaptive search: add N trials to the sweep directory given")


def cmd_sweep(args: argparse.Namespace) -> int:
    from jobs.submission.request import entry_module
    from jobs.sweeps import arrays as sw

    started = time.monotonic()
    if is_search(args):
        return _cmd_search(args, started)
    spec = load_from_args(args)
    no_sinfo = args.dry_run and shutil.which("sinfo") is None
    request = sw.check_sweep(spec, local_check=not (args.no_cluster_check or no_sinfo))
    plans = sw.plan(spec)
    parallelism = spec.configs[0].slurm.array_parallelism
    if args.pack is not None:
        return _cmd_pack(args, spec, request, plans, started)
    if args.dry_run:
        for p in plans:
            print(f"{p.trial.index:5d}  {p.trial.trial_id}  {p.action:9s}  {shlex.join(p.trial.overrides)}")
            if p.cfg.script.enabled:  # what this trial's ranks run, exactly
                print(f"{'':18}runs: {shlex.join(p.cfg.script.command())}")
        count = len(sw.to_run(plans))
        entry = entry_module(spec.configs[0])
        print(
            f"# array script for {count} trials (nothing submitted); each task runs {entry}.run(RUN_DIR) on its "
            f"trial's run directory, as python -m {entry} RUN_DIR would"
        )
        print(sw.render_array_script(spec, request, max(1, count), parallelism))
        return 0
    todo = len(sw.to_run(plans))
    limits.check_room(todo, spec.configs[0].slurm.qos, spec.configs[0].slurm.partition or "")  # every task counts
    arrays = sw.submit_sweep(spec, plans, parallelism, request)
    print(sw.summary(spec, plans, arrays, sw.max_array_size() if arrays else None))
    print(f"took:    {time.monotonic() - started:.1f} s")
    return 0


def _cmd_pack(args: argparse.Namespace, spec: Sweep, request: Any, plans: list[Any], started: float) -> int:
    """``ddpjob sweep --pack [N]``: the sweep's trials in a few allocations of slots (``jobs.sweeps.pack``)."""
    from jobs.sweeps import arrays as sw
    from jobs.sweeps import pack

    cfg = spec.configs[0]
    todo = sw.to_run(plans)
    packing, lines = _packing(cfg, request, len(todo), cfg.slurm.array_parallelism, args.pack)
    if args.dry_run:
        slots = packing.allocations * packing.per_node
        for i, p in enumerate(todo):
            where = f"slot {i % slots}" if i < slots else "the next free slot"
            keys = shlex.join(p.trial.overrides)
            print(f"{p.trial.index:5d}  {p.trial.trial_id}  {p.action:9s}  {where:18s}  {keys}")
        print("\n".join(lines))
        print(f"# pack script for {packing.allocations} allocations (nothing submitted): each runs its slots' pool")
        print(pack.render_pack_script(spec, packing))
        return 0
    limits.check_room(packing.allocations, cfg.slurm.qos, cfg.slurm.partition or "")
    array = pack.submit_pack(spec, plans, packing)
    print(sw.summary(spec, plans, []))
    print("\n".join(lines))
    print(f"arrays:  {array or 'none submitted (nothing left to run)'}")
    print(f"took:    {time.monotonic() - started:.1f} s")
    return 0


def _packing(cfg: Any, request: Any, trials: int, parallelism: int, allocations: int) -> tuple[Any, list[str]]:
    """The pack of ``trials`` trials (``jobs.sweeps.pack.plan_pack``) on the config's partition, and its line."""
    from jobs.submission import partitions
    from jobs.sweeps import pack

    if shutil.which("sinfo") is None:
        raise DdpJobError("--pack sizes its slots by the partition's nodes: sinfo is not here", "run it on the cluster")
    part = partitions.pick_partition(partitions.query_partitions(), cfg.slurm.partition)
    packing = pack.plan_pack(request, cfg.slurm.mem_gb, part, trials, parallelism, allocations)
    size, gpus = packing.size, f", {packing.size.gpus} GPUs" if packing.size.gpus else ""
    line = (
        f"pack:    {packing.allocations} allocations of 1 node ({part.name}), {packing.per_node} slots each: "
        f"{size.tasks} tasks x {size.cpus} CPUs{gpus} per slot"
    )
    return packing, [line]


def is_search(args: argparse.Namespace) -> bool:
    """Whether ``ddpjob sweep ARGS`` is an adaptive search (``--search``, ``--more``, or a search's file)."""
    return bool(args.search or args.more is not None or _is_search(args.config))


def load_from_args(args: argparse.Namespace) -> Sweep:
    """The grid or random sweep ``ddpjob sweep ARGS`` names, loaded and validated (``ddpjob --host`` checks it too)."""
    from jobs.sweeps.spec import load_sweep

    config, overrides = args.config, list(args.overrides)
    if config is not None and "=" in config and not Path(config).exists():
        overrides.insert(0, config)  # `sweep --script t.py k=v1,v2`: argparse took the first key for CONFIG
        config = None
    if args.no_snapshot:
        overrides.append("snapshot.enabled=false")
    return load_sweep(
        None if config is None else Path(config),
        overrides,
        trials=args.trials,
        seed=args.seed,
        name=args.name,
        script=args.script,
        script_args=args.script_args,
    )


def _is_search(config: Optional[str]) -> bool:
    from jobs.sweeps.search import is_search
    from jobs.sweeps.spec import is_sweep_file

    if config is None or not Path(config).exists():
        return False
    if is_search(config):
        return True
    return Path(config).is_file() and is_sweep_file(Path(config)) and _has_search(Path(config))


def _has_search(path: Path) -> bool:
    from ddp_core.config.input import read_yaml_mapping

    return "search" in read_yaml_mapping(path)


def _cmd_search(args: argparse.Namespace, started: float) -> int:
    """``ddpjob sweep`` of an adaptive search: a new one, the same one again, or ``SWEEP_DIR --more N``."""
    from jobs.sweeps import pack, search
    from jobs.sweeps.search_spec import load_search_file, parse_cli_search

    if search.is_search(args.config):
        if args.overrides or args.search:
            raise DdpJobError("a search's sweep directory takes no parameters", "only --more N (and --parallel)")
        root = Path(args.config).resolve()
        array = search.extend(root, args.more, args.parallel) if args.more is not None else None
        if args.more is None:
            array = search.submit_workers(root, *search.recorded(root))
    else:
        if args.more is not None:
            raise DdpJobError("--more extends an existing search", "pass its directory: ddpjob sweep DIR --more N")
        if args.config is None:
            raise DdpJobError("an adaptive search needs a base config or a sweep YAML", "sweep CONFIG --search tpe")
        flags = {
            "sampler": args.search,
            "trials": args.trials,
            "parallelism": args.parallel,
            "pruner": args.pruner,
            "seed": args.seed,
            "metric": args.metric,
        }
        overrides = [*args.overrides, *(["snapshot.enabled=false"] if args.no_snapshot else [])]
        if Path(args.config).is_file() and _has_search(Path(args.config)):
            spec = load_search_file(Path(args.config), overrides, name=args.name, **flags)
        else:
            spec = parse_cli_search(Path(args.config), overrides, name=args.name, **flags)
        cfg, request = search.check(spec, local_check=not (args.no_cluster_check or args.dry_run))
        packed, lines = None, list[str]()
        if args.pack is not None:  # the workers are the slots of packed allocations
            packing, lines = _packing(cfg, request, spec.trials, spec.parallelism, args.pack)
            packed = pack.pack_spec(packing, cfg.slurm.warning)
        if args.dry_run:
            print(
                f"search:  {spec.sampler} {spec.direction} {spec.metric}, {spec.trials} trials, "
                f"{spec.parallelism} workers, pruner {spec.pruner} (nothing submitted)"
            )
            for key, dist in spec.params.items():
                print(f"param:   {key} {json.dumps(dist)}")
            line = pack.step(request)
            print(f"step:    {shlex.join([*line['srun'], *line['command'], 'RUN_DIR'])}")
            print("\n".join(lines))
            return 0
        root, array = search.start(spec, cfg, request, packed)
    print("\n".join(search.start_lines(root, array)))
    print(f"took:    {time.monotonic() - started:.1f} s")
    return 0


COMMANDS = {"sweep": cmd_sweep}
