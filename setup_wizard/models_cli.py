"""`strata-setup models list|show|add|pull|verify|rm|gc` and `strata-setup convert`: typer commands over plain
functions.

The functions (`list_models`, `show_model`, `verify_models`, `remove_models`, `collect_garbage`, plus
`hub.pull` / `hub.download_entry` / `hub_add.add_model` / `convert.convert_to_store` / `convert.convert_dflash2`)
return plain data; the
commands print it as a rich table or, with `--json`, one JSON object. Exit codes: 0 ok, 1 the work failed
(network, checksum, disk), 2 bad input (unknown name, unpinned entry, a checkpoint that breaks the contract, removing
what a config uses without --force).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import typer
from rich import box
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from runtime.errors import exit_code, message
from runtime.formats.registry import QTYPES
from setup_wizard.catalog import Catalog, CatalogEntry, CatalogError, load_catalog
from setup_wizard.store import Store, StoreItem
from setup_wizard.store_fs import writing
from setup_wizard.store_locks import ItemBusy, item_lock, store_lock

models_app = typer.Typer(name="models", help="Manage the local model store (catalog entries, downloads, "
                                              "converted drafters).", no_args_is_help=True, add_completion=False)


class InUseError(CatalogError):
    """Removing something a config uses (exit code 2; pass --force)."""


# ---------------------------------------------------------------------------------------------------------------
# plain functions

def _fmt_size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _entry_state(entry: CatalogEntry, store: Store) -> tuple[str, StoreItem | None]:
    from setup_wizard.hub import entry_dir, verified_entry

    if not entry.pinned:
        return "unpinned", None
    d = entry_dir(entry, store)
    m = store.read_manifest(d)
    item = StoreItem(d, m) if m else None
    if verified_entry(entry, store) is not None:
        return "verified", item
    if m and m.get("verify_failed"):
        return "failed", item
    if d.exists():
        return "partial", item
    return "not downloaded", None


def list_models(store: Store | None = None, catalog: Catalog | None = None) -> list[dict[str, Any]]:
    """Catalog entries (with their store state) and every store item, with the configs that use it."""
    store = store or Store()
    cat = catalog or load_catalog()
    refs = store.references(prune=False)
    rows: list[dict[str, Any]] = []
    seen: set[Path] = set()
    for e in cat:
        state, item = _entry_state(e, store)
        if item is not None:
            seen.add(item.path.resolve())
        rows.append({"name": e.name, "kind": e.kind, "quant": "bf16" if e.is_head else (e.quant or "-"),
                     "source": e.source, "repo": e.repo, "revision": e.revision, "pinned": e.pinned,
                     "size": e.size, "state": state, "path": str(item.path) if item else None,
                     "used_by": [str(c) for c in store.used_by(item, refs)] if item else [],
                     "default": e.default, "fits": list(e.fits), "description": e.description})
    for it in store.items():
        if it.path.resolve() in seen:
            continue
        m = it.manifest
        rows.append({"name": it.name, "kind": "dflash2-gguf" if it.kind == "converted" else m.get("entry_kind", "?"),
                     "quant": m.get("quant", "-"), "source": "converted" if it.kind == "converted" else
                     m.get("source", "?"), "repo": m.get("source_repo") or m.get("repo"),
                     "revision": m.get("source_revision") or m.get("revision"), "pinned": True, "size": it.size,
                     "state": "verified" if it.verified else ("failed" if m.get("verify_failed") else "unverified"),
                     "path": str(it.artifact_path), "used_by": [str(c) for c in store.used_by(it, refs)],
                     "default": False, "fits": [], "description": ""})
    return rows


def show_model(name: str, store: Store | None = None, catalog: Catalog | None = None) -> dict[str, Any]:
    store = store or Store()
    cat = catalog or load_catalog()
    if name in cat:
        e = cat.get(name)
        state, item = _entry_state(e, store)
        doc = e.to_dict()
        refs = store.references(prune=False)
        doc.update({"state": state, "path": str(item.path) if item else None,
                    "used_by": [str(c) for c in store.used_by(item, refs)] if item else []})
        doc["converted"] = [{"path": str(it.artifact_path), "quant": it.manifest.get("quant"),
                             "sha256": it.manifest.get("sha256"), "size": it.size}
                            for it in store.items() if it.kind == "converted" and it.manifest.get("source_name") == name]
        if not e.pinned:
            doc["note"] = e.unpinned_message()
        return doc
    for it in store.items():
        if it.name == name:
            return {"name": it.name, "kind": it.kind, "path": str(it.artifact_path), "manifest": it.manifest,
                    "used_by": [str(c) for c in store.used_by(it, store.references(prune=False))]}
    raise CatalogError(f"{name!r} is neither a catalog entry nor an item in the store; see `strata-setup models "
                       f"list`.")


def _select(name: str | None, store: Store, cat: Catalog) -> list[StoreItem]:
    items = list(store.items())
    if name is None:
        return items
    out = [it for it in items if it.name == name or it.manifest.get("name") == name
           or it.manifest.get("source_name") == name]
    if not out:
        if name in cat:
            return []
        raise CatalogError(f"{name!r} is neither a catalog entry nor an item in the store; see `strata-setup "
                           f"models list`.")
    return out


def verify_models(name: str | None = None, store: Store | None = None,
                  catalog: Catalog | None = None) -> list[dict[str, Any]]:
    """Re-hash store items (all, or those of `name`); a failed item is marked (under its lock) so that nothing
    uses it: strata-run refuses it and setup repairs it."""
    store = store or Store()
    cat = catalog or load_catalog()
    res = []
    for it in _select(name, store, cat):
        problems = store.verify_item(it)
        if problems and not it.manifest.get("corrupt"):
            with writing(store.root, f"the mark of {it.name}", then="run `strata-setup models verify` again"), \
                    item_lock(store.root, it.path, what=it.name):
                now = store.read_manifest(it.path)
                if now is not None and not now.get("corrupt"):
                    store.write_manifest(it.path, {**now, "verified": False, "verify_failed": problems[0]})
        res.append({"name": it.name, "kind": it.kind, "path": str(it.artifact_path), "ok": not problems,
                    "problems": problems})
    return res


def remove_models(name: str, *, force: bool = False, store: Store | None = None,
                  catalog: Catalog | None = None) -> list[dict[str, Any]]:
    """Remove the store items of `name` (an entry's download and its converted files, or one item by name). Refuses
    what a live config uses (InUseError, exit 2) unless `force`, and what a running setup or pull holds (ItemBusy)."""
    store = store or Store()
    cat = catalog or load_catalog()
    with writing(store.root, "the store", then="run the command again"), \
            store_lock(store.root, what="the store (another gc or rm is running)"), ExitStack() as locks:
        items = _select(name, store, cat)
        for it in items:
            locks.enter_context(item_lock(store.root, it.path, what=it.name, wait=False))
        refs = store.references()      # read under the item locks: a setup registers its config before it lets go
        users = {str(it.path): [str(c) for c in store.used_by(it, refs)] for it in items}
        busy = [(it, users[str(it.path)]) for it in items if users[str(it.path)]]
        if busy and not force:
            it, cfgs = busy[0]
            raise InUseError(f"{it.name} is used by {', '.join(cfgs)}; remove those configs first, or pass --force.")
        for it in items:
            store.remove(it)
    return [{"name": it.name, "path": str(it.path), "size": it.size, "used_by": users[str(it.path)]} for it in items]


def collect_garbage(*, dry_run: bool = False, force: bool = False, store: Store | None = None,
                    confirm: Callable[[dict[str, Any]], bool] | None = None) -> dict[str, Any]:
    """Remove what no live config uses: item folders (verified, failed or partial), leftover `.part`/`.tmp` files,
    and stray files or links where the store keeps folders. Items a running setup or pull holds are left alone and
    reported as busy; items a live config uses are kept unless `force`. `confirm(plan)` may refuse the removal
    (the plan is what will be removed, computed under the locks, so it is exactly what happens)."""
    store = store or Store()
    if not store.root.exists():
        return {"dry_run": dry_run, "removed": [], "leftovers": [], "strays": [], "busy": [], "kept": [],
                "freed_bytes": 0, "cancelled": False}
    with writing(store.root, "the store", then="run gc again"), \
            store_lock(store.root, what="the store (another gc or rm is running)"), ExitStack() as locks:
        items, strays = store.item_dirs()
        mine: list[StoreItem] = []
        busy: list[StoreItem] = []
        for it in items:
            try:
                locks.enter_context(item_lock(store.root, it.path, what=it.name, wait=False))
                mine.append(it)
            except ItemBusy:
                busy.append(it)
        refs = store.references()      # after the locks: a setup registers its config before it lets go of them
        remove, kept = [], []
        for it in mine:
            users = [str(c) for c in store.used_by(it, refs)]
            (remove if force or not users else kept).append((it, users))
        leftovers = [p for it, _ in kept for p in store.leftovers(it)]
        freed = sum(it.size for it, _ in remove) + sum(p.lstat().st_size for p in leftovers if p.exists())
        plan = {"dry_run": dry_run,
                "removed": [{"name": it.name, "path": str(it.path), "size": it.size, "used_by": u} for it, u in remove],
                "leftovers": [str(p) for p in leftovers], "strays": [str(p) for p in strays],
                "busy": [{"name": it.name, "path": str(it.path)} for it in busy],
                "kept": [{"name": it.name, "path": str(it.path), "used_by": u} for it, u in kept],
                "freed_bytes": freed, "cancelled": False}
        if dry_run or not (remove or leftovers or strays):
            return plan
        if confirm is not None and not confirm(plan):
            return {**plan, "cancelled": True, "freed_bytes": 0}
        for it, _ in remove:
            store.remove(it)
        for p in leftovers:
            p.unlink(missing_ok=True)
        for p in strays:
            store.remove(p)
    return plan


# ---------------------------------------------------------------------------------------------------------------
# commands

def _run(fn: Callable[[], Any], debug: bool) -> Any:
    try:
        return fn()
    except typer.Exit:
        raise
    except KeyboardInterrupt:
        Console(stderr=True).print("\nCancelled; nothing incomplete was left visible. Run the command again to "
                                   "continue (downloads resume).")
        raise typer.Exit(130) from None
    except Exception as exc:
        if debug:
            raise
        code = exit_code(exc)
        msg = message(exc) if code else f"Unexpected error: {exc} (rerun with --debug for details)."
        Console(stderr=True).print(f"[red]Error:[/red] {msg}", highlight=False, soft_wrap=True)
        raise typer.Exit(code or 1) from None


def _print_json(doc: Any) -> None:
    print(json.dumps(doc, indent=2, default=str))


JSON = typer.Option(False, "--json", help="Print one JSON object.")
DEBUG = typer.Option(False, "--debug", help="Show tracebacks.")


@models_app.command("list")
def list_cmd(json_out: bool = JSON, debug: bool = DEBUG) -> None:
    """Catalog entries and store items: kind, quant, size, pinned revision, verified state, configs using them."""
    rows = _run(list_models, debug)
    if json_out:
        return _print_json({"models": rows})
    console = Console()
    for part in list_renderables(rows, console.width):
        console.print(part, soft_wrap=not isinstance(part, Table), highlight=False)


def _list_cells(r: Mapping[str, Any]) -> list[str]:
    rev = (r["revision"] or "")[:12] if r["pinned"] else "unpinned"
    return [r["kind"], r["quant"], _fmt_size(r["size"]) if r["size"] else "-", rev, r["state"],
            ", ".join(Path(c).name for c in r["used_by"]) or "-"]


LIST_COLUMNS = ("kind", "quant", "size", "revision", "state", "used by")


def list_renderables(rows: list[Mapping[str, Any]], width: int) -> list[Any]:
    """The `models list` table when it fits `width` with every name whole; else one block per model (its name on
    a line of its own, the rest below), so a name (what users type) is never broken mid-word."""
    names = [r["name"] + (" (default)" if r["default"] else "") for r in rows]
    t = Table(title="Models", box=box.SIMPLE_HEAD, pad_edge=False)
    t.add_column("name", no_wrap=True, min_width=max((len(n) for n in names), default=4))
    for c in LIST_COLUMNS:
        t.add_column(c, no_wrap=c not in ("state", "used by"), overflow="fold" if c == "used by" else "ellipsis")
    cells = [_list_cells(r) for r in rows]
    for name, row in zip(names, cells, strict=True):
        t.add_row(name, *row)
    need = Measurement.get(Console(width=10_000), Console(width=10_000).options, t).minimum
    if need <= width:
        return [t]
    out: list[Any] = [Text("Models", style="italic")]
    for name, row in zip(names, cells, strict=True):
        out.append(Text(name, style="bold"))
        out.append(Text("  " + "  ".join(f"{k}: {v}" for k, v in zip(LIST_COLUMNS, row, strict=True))))
    return out


def _show_value(key: str, v: Any) -> str:
    """One field of `models show` in words (never a Python repr)."""
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if key == "size" and isinstance(v, int):
        return f"{_fmt_size(v)} ({v:,} bytes)"
    if isinstance(v, Mapping):
        return "\n".join(f"{k}: {_show_value(str(k), x) if not isinstance(x, Mapping | list) else json.dumps(x)}"
                         for k, x in v.items()) or "-"
    if isinstance(v, list | tuple):
        return ", ".join(_show_value(key, x) for x in v) or "-"
    return str(v)


def show_renderables(doc: Mapping[str, Any]) -> list[Any]:
    """`models show` as a two-column table of fields, then each list of files (path, size, sha256 whole on one
    line each)."""
    t = Table(box=box.SIMPLE, show_header=False, pad_edge=False)
    t.add_column("field", style="bold", no_wrap=True)
    t.add_column("value", overflow="fold")
    lists: list[tuple[str, list[Mapping[str, Any]]]] = []
    for k, v in doc.items():
        if isinstance(v, list) and v and all(isinstance(x, Mapping) for x in v):
            lists.append((k, v))
            continue
        if isinstance(v, Mapping) and isinstance(v.get("files"), list):      # a store item's manifest
            v = {kk: vv for kk, vv in v.items() if kk != "files"}
            lists.append((f"{k} files", doc[k]["files"]))
        t.add_row(k.replace("_", " "), _show_value(k, v))
    out: list[Any] = [t]
    for title, items in lists:
        out.append(Text(f"{title.replace('_', ' ')}:", style="bold"))
        for x in items:
            bits = [str(x.get("path") or x.get("name") or "")]
            if x.get("quant"):
                bits.append(str(x["quant"]))
            if isinstance(x.get("size"), int):
                bits.append(_fmt_size(x["size"]))
            if x.get("sha256"):
                bits.append(f"sha256 {x['sha256']}")
            out.append(Text("  " + "  ".join(b for b in bits if b)))
    return out


@models_app.command("show")
def show_cmd(name: str = typer.Argument(..., help="Catalog entry or store item name."), json_out: bool = JSON,
             debug: bool = DEBUG) -> None:
    """Everything known about one model: pins, files, store state, converted artifacts, configs using it."""
    doc = _run(lambda: show_model(name), debug)
    if json_out:
        return _print_json(doc)
    console = Console()
    for part in show_renderables(doc):
        console.print(part, soft_wrap=not isinstance(part, Table), highlight=False)


@models_app.command("add")
def add_cmd(repo: str = typer.Argument(..., help="Hub repository id, such as Qwen/Qwen3-30B-A3B."),
            revision: str | None = typer.Option(None, "--revision", help="Branch, tag or commit (default: main); "
                                                "pinned as the full commit it is now."),
            name: str | None = typer.Option(None, "--name", help="Catalog name (default: the repository's name, "
                                            "lower case)."),
            kind: str | None = typer.Option(None, "--kind", help="target | dflash2 | dflash (default: from "
                                            "config.json and the weights)."),
            file: str | None = typer.Option(None, "--file", help="One .gguf file of the repository (a llama.cpp "
                                            "qwen3moe GGUF, such as Qwen3-30B-A3B-Q4_K_M.gguf), pinned as a "
                                            "target that runs as it is stored."),
            yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask on a terminal."),
            json_out: bool = JSON, debug: bool = DEBUG) -> None:
    """Pin a Hub repository into your catalog: its commit, and every file's size and sha256 as the Hub publishes
    them; config.json and the safetensors headers (a GGUF file's header) are checked first (no weights are
    downloaded)."""
    from setup_wizard.hub_add import add_model

    out = Console(stderr=json_out)

    def show(found) -> None:
        if not json_out:
            for line in found.lines():
                out.print(line, highlight=False, soft_wrap=True)

    def ask(found) -> bool:
        return typer.confirm(f"Add {found.name} to {found.catalog}?", default=True)

    confirm = ask if _interactive() and not yes and not json_out else None
    found, written = _run(lambda: add_model(repo, revision=revision, name=name, kind=kind, show=show,
                                            confirm=confirm, file=file), debug)
    if json_out:
        return _print_json({"added": written, **found.to_dict()})
    if not written:
        out.print("Nothing was added.")
        return
    out.print(f"Added {found.name} to {found.catalog} (pinned at {found.revision}).", highlight=False,
              soft_wrap=True)
    if found.is_head and found.ready:
        out.print(f"Use it: strata-setup --target {found.ready[0]} --dflash2-head {found.name}", highlight=False,
                  soft_wrap=True)
    elif found.is_head:
        out.print(f"Pin a target it fits first ({', '.join(found.fits)}): strata-setup models add ORG/TARGET",
                  highlight=False, soft_wrap=True)
    else:
        out.print(f"Download it now: strata-setup models pull {found.name} ({_fmt_size(found.size)}), or set it "
                  f"up (downloads first): strata-setup --target {found.name}", highlight=False, soft_wrap=True)


@models_app.command("pull")
def pull_cmd(name: str = typer.Argument(..., help="Catalog entry to download and verify."),
             offline: bool = typer.Option(False, "--offline", help="Use only what the store already verified."),
             json_out: bool = JSON, debug: bool = DEBUG) -> None:
    """Download and verify one catalog entry (and nothing else)."""
    from setup_wizard.hub import pull
    from setup_wizard.progress_view import progress_bars

    def work():
        with progress_bars(Console(stderr=True)) as bars:
            return pull(name, offline=offline or None, on_progress=bars)

    res = _run(work, debug)
    doc = {"name": res.name, "path": str(res.path), "revision": res.revision, "sha256": res.sha256,
           "size": res.size, "reused": res.reused, "files": res.files}
    if json_out:
        return _print_json(doc)
    Console().print(f"{res.name}: {'already verified' if res.reused else 'downloaded and verified'} in {res.path}",
                    soft_wrap=True)


def _retry_hint(row: Mapping[str, Any]) -> str:
    if row.get("kind") == "converted":
        return "rerun strata-setup (or strata-setup convert) to rebuild it"
    return f"pull it again with `strata-setup models pull {row['name']}`"


@models_app.command("verify")
def verify_cmd(name: str | None = typer.Argument(None, help="Only this entry/item (default: everything)."),
               json_out: bool = JSON, debug: bool = DEBUG) -> None:
    """Re-hash what the store holds; exit 1 when anything fails (it is then marked and never used)."""
    res = _run(lambda: verify_models(name), debug)
    if json_out:
        _print_json({"results": res, "ok": all(r["ok"] for r in res)})
    else:
        c = Console()
        if not res:
            c.print("Nothing in the store to verify.")
        for r in res:
            c.print(f"{'[green]ok[/green]' if r['ok'] else '[red]FAILED[/red]'}  {r['name']}  {r['path']}"
                    + ("" if r["ok"] else f"  ({r['problems'][0]}; {_retry_hint(r)})"), highlight=False)
    if not all(r["ok"] for r in res):
        raise typer.Exit(1)


@models_app.command("rm")
def rm_cmd(name: str = typer.Argument(..., help="Entry or item name."),
           force: bool = typer.Option(False, "--force", help="Remove even what a config uses."),
           json_out: bool = JSON, debug: bool = DEBUG) -> None:
    """Remove a model from the store (refuses what a config uses unless --force)."""
    res = _run(lambda: remove_models(name, force=force), debug)
    if json_out:
        return _print_json({"removed": res})
    Console().print("\n".join(f"removed {r['name']} ({_fmt_size(r['size'])}) {r['path']}" for r in res)
                    or f"{name} has nothing in the store.")


def _interactive() -> bool:
    return sys.stdin.isatty() and sys.stdout.isatty()


def _gc_lines(res: Mapping[str, Any], verb: str) -> list[str]:
    lines = []
    for r in res["removed"]:
        used = f" (used by {', '.join(r['used_by'])})" if r.get("used_by") else ""
        lines.append(f"{verb} {r['name']} ({_fmt_size(r['size'])}) {r['path']}{used}")
    lines += [f"{verb} leftover {p}" for p in res["leftovers"]]
    lines += [f"{verb} stray {p}" for p in res.get("strays", [])]
    return lines


@models_app.command("gc")
def gc_cmd(dry_run: bool = typer.Option(False, "--dry-run", help="Only say what would be removed."),
           force: bool = typer.Option(False, "--force", help="Also remove what a live config uses."),
           yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask on a terminal."),
           json_out: bool = JSON, debug: bool = DEBUG) -> None:
    """Remove store items that no live config uses (configs strata-setup wrote, wherever they are), partial
    folders and leftover temporary files; lists them and asks first on a terminal."""
    c = Console()

    def ask(plan: Mapping[str, Any]) -> bool:
        for line in _gc_lines(plan, "will remove"):
            c.print(line, highlight=False, soft_wrap=True)
        return typer.confirm(f"Remove these ({_fmt_size(plan['freed_bytes'])})?", default=False)

    confirm = ask if _interactive() and not yes and not json_out else None
    res = _run(lambda: collect_garbage(dry_run=dry_run, force=force, confirm=confirm), debug)
    if json_out:
        return _print_json(res)
    if res["cancelled"]:
        c.print("Nothing was removed.")
        return
    for line in _gc_lines(res, "would remove" if dry_run else "removed"):
        c.print(line, highlight=False, soft_wrap=True)
    for r in res["busy"]:
        c.print(f"kept {r['name']}: a running strata-setup command is using it", highlight=False)
    c.print(f"{'would free' if dry_run else 'freed'} {_fmt_size(res['freed_bytes'])}")


def convert_cmd(
    src: Path = typer.Argument(..., help="DFlash2 checkpoint folder or its .safetensors file (config.json beside)."),
    quant: str = typer.Option(..., "--quant", help=" | ".join(QTYPES) + " (backbone matrices)."),
    out: Path = typer.Option(..., "-o", "--out", help="Output .gguf path."),
    source_repo: str = typer.Option("", "--source-repo", help="Recorded as strata.source.repo."),
    source_revision: str = typer.Option("", "--source-revision", help="Recorded as strata.source.revision."),
    json_out: bool = JSON,
    debug: bool = DEBUG,
) -> None:
    """Convert a DFlash2 checkpoint to GGUF (validated, streamed, verified by reading it back)."""
    from setup_wizard.convert import convert_dflash2
    from setup_wizard.progress_view import progress_bars

    if out.is_dir():
        Console(stderr=True).print(f"[red]Error:[/red] -o {out} is a folder; pass the output file path, such as "
                                   f"{out / 'dflash2.gguf'}.", highlight=False, soft_wrap=True)
        raise typer.Exit(2)

    def work():
        with progress_bars(Console(stderr=True)) as bars:
            return convert_dflash2(src, quant, out, source_repo=source_repo, source_revision=source_revision,
                                   on_tensor=lambda n, i, tot: bars(f"converting to {quant}", i, tot))

    res = _run(work, debug)
    doc = {"path": str(res.path), "sha256": res.sha256, "size": res.size, "quant": res.quant,
           "source_sha256": res.source_sha256, "converter_version": res.converter_version}
    if json_out:
        return _print_json(doc)
    Console().print(f"wrote {res.path} ({_fmt_size(res.size)}, {res.quant}), sha256 {res.sha256}", highlight=False,
                    soft_wrap=True)
