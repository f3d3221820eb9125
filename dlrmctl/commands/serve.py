"""``dlrmctl serve MODEL_DIR``: an exported model behind the Open Inference Protocol (KServe v2)
with dynamic batching; the server is :mod:`dlrmctl.inference.serve`."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Optional

import typer

from dlrmctl.commands._common import echo, fail, show_path
from dlrmctl.commands.options import check_numbers, number_option


def serve_command(
    model_dir: Path = typer.Argument(..., help="exported model directory (dlrmctl export)"),
    host: str = typer.Option("127.0.0.1", "--host", help="address to listen on (0.0.0.0: every interface)"),
    port: Annotated[int, number_option("--port", help="TCP port (0: any free port, printed)", what="TCP port",
                                       maximum=65535, positive=False)] = 8080,
    max_batch_rows: Annotated[int, number_option(
        "--max-batch-rows", help="rows merged into one forward at most (1: no dynamic batching)", what="rows")] = 4096,
    max_delay_ms: Annotated[float, number_option(
        "--max-delay-ms", help="longest wait of the oldest queued request for others to join its batch (it waits "
        "only while more requests are arriving)", what="milliseconds", maximum=60000.0, positive=False)] = 2.0,
    min_delay_ms: Annotated[float, number_option(
        "--min-delay-ms", help="wait of the oldest queued request for others even when none is arriving (larger "
        "batches, more latency; = --max-delay-ms: a fixed delay)", what="milliseconds (at most --max-delay-ms)",
        at_most="max_delay_ms", positive=False)] = 0.0,
    max_queue_rows: Annotated[int, number_option(
        "--max-queue-rows", help="rows waiting at most; beyond, 503 + Retry-After", what="rows")] = 65536,
    max_request_mb: Annotated[float, number_option(
        "--max-request-mb", help="largest infer request body in MiB; beyond, 413", what="MiB",
        maximum=65536.0)] = 64.0,
    max_ids_per_row: Annotated[int, number_option(
        "--max-ids-per-row", help="ids a request may carry per row, all features together (checked before its data "
        "is read); beyond, 400", what="ids", maximum=1 << 24)] = 1024,
    workers: Annotated[int, number_option(
        "--workers", help="forward threads per process (each takes the next batch; the intra-op threads are divided "
        "among them)", what="forward threads", maximum=256)] = 1,
    processes: Annotated[int, number_option(
        "--processes", help="server processes sharing the port (SO_REUSEPORT), each with the model, its own queue "
        "and metrics; the kernel spreads connections over them", what="server processes", maximum=256)] = 1,
    max_restarts: Annotated[int, number_option(
        "--max-restarts", help="with --processes: times a server process that exits is started again, all "
        "together; beyond, the server stops with an error (0: at the first exit)", what="restarts", maximum=1000,
        positive=False)] = 3,
    device: str = typer.Option("cpu", "--device", help="where the model runs: cpu, cuda[:i], or auto (cuda where "
                                                       "a GPU is visible, else cpu); requests are decoded on the "
                                                       "host, each batch moved once"),
    name: Optional[str] = typer.Option(None, "--name", help="model name in /v2/models/{name} (default: the run's name)"),
    artifact: Optional[str] = typer.Option(None, "--artifact", help="aoti | pt2 | torchscript (default: the fastest "
                                                                   "per request the export holds that runs on "
                                                                   "--device: aoti, else pt2, else torchscript)"),
) -> None:
    """Serve an exported model over the Open Inference Protocol (KServe v2 REST) with dynamic batching, until SIGTERM or Ctrl-C."""
    check_numbers(serve_command, locals())  # each number option's range, as declared above
    if not re.fullmatch(r"cpu|auto|cuda(:\d+)?", device):
        fail(f"--device must be cpu, cuda, cuda:N or auto, got {device!r}")
    if name is not None:
        from dlrmctl.inference.serve.protocol import check_model_name

        check_model_name(name)
    _check_address(host, port, processes)
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        fail(f"dlrmctl serve needs the serve extra ({e.name} is not installed): pip install 'dlrmctl[serve]'")
    import torch

    from dlrmctl.inference.export import load_exported
    from dlrmctl.inference.predict import check_vocabularies
    from dlrmctl.inference.serve.processes import bind, http_stack, serve, start_processes
    from dlrmctl.inference.serve.protocol import ServeError, check_model_name
    from dlrmctl.procs import intra_op_threads

    device = serve_device(device)
    model = load_exported(model_dir, device, artifact)
    check_vocabularies(model)
    threads, why = intra_op_threads(workers * processes)
    where = f"on {device}; " if device != "cpu" else ""
    torch.set_num_threads(threads)
    served = name or (model.manifest.get("source") or {}).get("name") or Path(model_dir).resolve().name
    if name is None:
        check_model_name(served, f"{show_path(model_dir)}: the default model name (the run's name; give --name)")
    sock = bind(host, port, reuse_port=processes > 1)
    addr = sock.getsockname()
    options = dict(max_batch_rows=max_batch_rows, max_delay_ms=max_delay_ms, min_delay_ms=min_delay_ms,
                   max_queue_rows=max_queue_rows, workers=workers, max_request_mb=max_request_mb,
                   max_ids_per_row=max_ids_per_row)
    try:
        others = start_processes(processes - 1, str(model_dir), served, host, addr[1], threads, options, device=device,
                                 artifact=model.runner)
    except ServeError:
        sock.close()
        raise
    http, loop = http_stack()
    h = f"[{addr[0]}]" if ":" in addr[0] else addr[0]
    procs = f"{processes} processes x " if processes > 1 else ""
    if min_delay_ms == max_delay_ms:
        wait = f"{max_delay_ms:g} ms"
    else:
        wait = f"{f'{min_delay_ms:g}-' if min_delay_ms else '<= '}{max_delay_ms:g} ms while requests are arriving"
    echo(f"serving {show_path(model_dir)} ({model.format.file}, {model.format.title}) as model {served!r} at http://{h}:{addr[1]}/v2/models/{served} "
         f"(batches of <= {max_batch_rows:,} rows, waiting {wait}; queue {max_queue_rows:,} rows"
         f"{' per process' if processes > 1 else ''}; {procs}{workers} worker(s) x {threads} thread(s): {why}; "
         f"{where}HTTP {http} on {loop})")
    def respawn(k: int):
        return start_processes(1, str(model_dir), served, host, addr[1], threads, options, first=k, total=processes,
                               device=device, artifact=model.runner)[0]

    stopped = serve(model, served, sock, process=f"1 of {processes}", others=others, respawn=respawn,
                    max_restarts=max_restarts, **options)
    echo(f"stopped{f' ({stopped})' if stopped else ''}: every request received was answered")


def _check_address(host: str, port: int, processes: int) -> None:
    """Fail in one line, before torch and the model load, when ``host:port`` cannot be bound (in use,
    not a local address).  A probe: the server binds again when the model is ready (and says so
    there if the port was taken meanwhile)."""
    import socket

    if port == 0:
        return
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server's socket: TIME_WAIT is no obstacle
            s.bind((host, port))
    except OSError as e:
        fail(f"cannot listen on {host}:{port}: {e.strerror or e}; choose another --port (0: any free port) "
             "or --host")


def serve_device(option: str) -> str:
    """``--device`` -> the device the model is loaded on: ``auto`` is ``cuda`` where torch sees a GPU,
    else ``cpu``; ``cuda[:i]`` must be visible.

    Raises:
        CommandError: ``cuda`` asked for where torch sees no GPU (a CPU build of torch, or none
            visible), or an index beyond the GPUs seen.
    """
    import torch

    if option == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if option.startswith("cuda"):
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        i = int(option.partition(":")[2] or 0)
        if i >= n:
            fail(f"--device {option}: torch sees {n} CUDA device(s) (torch {torch.__version__}); "
                 "use --device cpu or auto")
    return option


def register(app: typer.Typer) -> None:
    """Add ``serve`` to the main ``dlrmctl`` app."""
    app.command("serve", short_help="Serve an exported model over KServe v2 REST, batched")(serve_command)
