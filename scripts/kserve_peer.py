"""The reference peer of ``scripts/bench_serve.py --versus-kserve``: KServe's own Python
``ModelServer`` (the Open Inference Protocol server of the ``kserve`` SDK) serving an exported
``model.pt2`` with the same work per request as ``dlrmctl serve``: JSON tensors ``dense``
FP32 ``[B, D]`` and one INT64 ``[B]`` id tensor per sparse feature -> the ``torch.export`` program
-> ``score`` FP32 ``[B]``.

    VENV/bin/python scripts/kserve_peer.py MODEL_DIR PORT NAME

Runs in its own virtual environment (``kserve`` and ``torch`` only; it imports nothing of dlrmctl).
Binds 127.0.0.1 only (KServe's REST server hard-codes ``0.0.0.0``: its ``uvicorn.Config`` host is
overridden here), REST only (no gRPC port), one worker, latency and access logs off (as dlrmctl's), ``OMP_NUM_THREADS``
intra-op threads (the benchmark gives both servers the same).
Prints ``serving ... at http://127.0.0.1:PORT/v2/models/NAME`` once the model is loaded.
"""

import json
import logging
import os
import sys
import uuid
from pathlib import Path

import numpy as np
import torch
import uvicorn
from kserve import InferOutput, InferRequest, InferResponse, Model, ModelServer


class LocalConfig(uvicorn.Config):
    """uvicorn's config with the host forced to 127.0.0.1 (the benchmark's traffic stays local)."""

    def __init__(self, *args, **kwargs):
        kwargs["host"] = "127.0.0.1"
        super().__init__(*args, **kwargs)


class DLRMProgram(Model):
    """The ``.pt2`` program behind KServe's v2 ``predict``: one forward per request (KServe has no
    dynamic batching)."""

    def __init__(self, name: str, model_dir: Path) -> None:
        super().__init__(name)
        manifest = json.loads((model_dir / "manifest.json").read_text())
        self.features = list(manifest["sparse_features"])
        self.program = torch.export.load(str(model_dir / "model.pt2")).module()
        self.ready = True

    def predict(self, payload: InferRequest, headers=None) -> InferResponse:
        got = {i.name: i for i in payload.inputs}
        dense = torch.from_numpy(np.ascontiguousarray(got["dense"].as_numpy(), np.float32))
        B = dense.shape[0]
        values = torch.from_numpy(np.concatenate([got[f].as_numpy().reshape(-1) for f in self.features]).astype(np.int64))
        lengths = torch.ones(len(self.features) * B, dtype=torch.int64)
        with torch.inference_mode():
            scores, _ = self.program(dense, values, lengths)
        return InferResponse(model_name=self.name, infer_outputs=[InferOutput("score", [B], "FP32", scores.numpy())],
                             response_id=payload.id or str(uuid.uuid4()))


def main() -> None:
    model_dir, port, name = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    uvicorn.Config = LocalConfig
    torch.set_grad_enabled(False)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or torch.get_num_threads()))
    model = DLRMProgram(name, model_dir)
    server = ModelServer(http_port=port, enable_grpc=False, workers=1, enable_latency_logging=False)
    logging.getLogger().setLevel(logging.WARNING)  # after ModelServer(), which configures KServe's logging
    for n in ("kserve", "kserve.trace", "uvicorn", "uvicorn.access", "uvicorn.error"):
        logging.getLogger(n).setLevel(logging.WARNING)
    print(f"serving {model_dir} (KServe ModelServer) at http://127.0.0.1:{port}/v2/models/{name} ", flush=True)
    server.start([model])


if __name__ == "__main__":
    main()
