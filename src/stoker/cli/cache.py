"""Commands on a node cache directory: ``stoker cache status|clear``."""

from __future__ import annotations

import json

from .._units import format_size
from ..cache.status import clear, status
from .args import size_arg


def _print_status(st: dict) -> None:
    print(f"{st['root']}: {st['used_bytes']:,} bytes of blocks")
    _print_access(st.get("access"))
    _print_budget(st)
    for ns, used in sorted(st["namespaces"].items()):
        q = st["quotas"].get(ns)
        print(f"  dataset {_dataset_label(st, ns)}: {used:,} bytes" + (f" (share {q:,})" if q is not None else ""))
    for r in st["jobs"]:
        rate = f"epoch {r['epoch_s']:.1f} s" if r.get("epoch_s") else "no epoch yet"
        label = _dataset_label(st, r["namespace"])
        print(f"  job pid {r['pid']}: dataset {label} ({r['dataset_bytes']:,} bytes), {rate}")
    if st["quotas"] == {} and not st["jobs"]:
        print("  no live job: no budget split to show")
    for name, info in st["stores"].items():
        print(f"  {name}: {info['bytes']:,} bytes in {info['path']}")
    if st["ignored"]:
        print("  not the cache's (never counted, evicted or cleared): " + ", ".join(st["ignored"]))
    for sub in st["nested"]:
        _print_status(sub)


def _print_access(acc: dict | None) -> None:
    """One line: the cache's file mode and owner (who may read the cached samples)."""
    if acc:
        mode = (
            f"mode {acc['mode']} (directories {acc['dir_mode']})"
            if acc["mode"]
            else "mode not recorded (made by an older stoker)"
        )
        print(f"  {mode}, owner {acc['owner']} (uid {acc['owner_uid']}, group {acc['group']})")


def _dataset_label(st: dict, ns: str) -> str:
    """``URL (version abcd1234…)`` of namespace ``ns``, or ``version <ns>`` where no URL was recorded."""
    url = (st.get("datasets", {}).get(ns) or {}).get("url")
    return f"{url} (version {ns[:12]})" if url else f"version {ns}"


def _print_budget(st: dict) -> None:
    budget = st.get("budget_bytes")
    if budget:
        given = st.get("budget_source") == "given"
        whose = "given with --budget" if given else "of the last job that opened it"
        print(f"  budget: {budget:,} bytes ({format_size(budget)}, {whose})")
    elif st.get("budget_source") is None and st["namespaces"]:
        print("  budget: not recorded (opened by an older stoker); pass --budget to show its split")


def cmd_status(a) -> int:
    """``stoker cache status DIR``: usage per dataset, live jobs, the budget split (text or ``--json``)."""
    st = status(a.dir, a.budget)
    if a.json:
        print(json.dumps(st, indent=2))
        return 0
    _print_status(st)
    return 0


def cmd_clear(a) -> int:
    """``stoker cache clear DIR``: prints the bytes freed."""
    freed = clear(a.dir, a.version)
    print(f"freed {freed:,} bytes")
    return 0


def add_parsers(sub) -> None:
    """Register ``stoker cache status|clear`` on the top-level subparsers ``sub``."""
    p = sub.add_parser("cache", help="inspect or clear a node cache directory")
    csub = p.add_subparsers(dest="cache_cmd", required=True)
    s = csub.add_parser("status", help="usage per dataset, live jobs, the policy's budget split")
    s.add_argument("dir")
    s.add_argument(
        "--budget",
        type=size_arg,
        help="show the future policy's split of this budget (e.g. 500GiB; default: the "
        "budget in force, that of the last job that opened the cache)",
    )
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_status)
    c = csub.add_parser("clear", help="delete cached blocks (refused while a job uses them)")
    c.add_argument("dir")
    c.add_argument(
        "--version",
        "--namespace",
        dest="version",
        help="only this dataset version: in full, or the 12 characters `stoker cache status` prints "
        "(any prefix that names one version)",
    )
    c.set_defaults(fn=cmd_clear)
