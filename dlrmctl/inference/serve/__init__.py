"""``dlrmctl serve MODEL_DIR``: an exported model behind the Open Inference Protocol (KServe v2, HTTP/REST).

Modules: :mod:`.protocol` (the model's contract, request decoding, answers), :mod:`.batcher`
(dynamic batching, metrics), :mod:`.app` (the ASGI app), :mod:`.processes` (socket, uvicorn, ``--processes``).

Built on FastAPI + uvicorn (the HTTP stack the ``kserve`` SDK's ``ModelServer`` runs on, without
that SDK's 30-odd extra packages; ``httptools`` + ``uvloop`` where installed) and ``prometheus-client``.
``POST .../infer`` is a raw ASGI route ahead of FastAPI (:class:`~.app.App`): a request's CPU is its HTTP
parsing, one JSON header parse and zero-copy views of its binary tensors, not per-request routing
and validation.  Endpoints:

* ``GET /v2/health/live``, ``GET /v2/health/ready``, ``GET /v2``;
* ``GET /v2/models/{name}`` (metadata: inputs, outputs, dtypes, shapes), ``GET /v2/models/{name}/ready``;
* ``POST /v2/models/{name}/infer``: JSON tensors, or Triton's binary tensor extension
  (``Inference-Header-Content-Length``; what ``tritonclient.http`` sends by default);
* ``GET /metrics``: Prometheus text (requests, rows, batch rows, latency, queue, errors).

Inputs of a request (``B`` rows; one of the two forms):

* tensors: ``dense`` FP32 ``[B, D]`` (transformed, as the model takes it); for every sparse
  feature ``f`` (``manifest["sparse_features"]``) ``f`` INT64 ``[N_f]`` ids and ``f.lengths``
  INT64 ``[B]`` bag lengths (optional: without it every row has exactly one id, ``N_f = B``);
  ``f.weights`` FP32 ``[N_f]`` for each weighted feature;
* ``raw`` BYTES ``[B]``: raw log lines (Criteo: 39 tab-separated fields, or 40 with the label
  first, which is ignored), through ``dlrmctl predict``'s transform (:func:`~dlrmctl.inference.predict.raw_transformer`).

Outputs: ``score`` FP32 ``[B]`` (``sigmoid(logit)``, as ``dlrmctl predict``) and ``logit`` FP32 ``[B]``.

Dynamic batching (:class:`~.batcher.Batcher`): requests are queued and merged into one forward of up to
``max_batch_rows`` rows or until ``max_delay_ms`` after the oldest queued request, whichever comes
first; a request is never split (one larger than ``max_batch_rows`` is a forward of its own);
each response gets exactly its own rows, in order.  The queue holds at most ``max_queue_rows``
rows: a request that does not fit gets 503 with ``Retry-After``.  A bad request (malformed JSON,
wrong dtype or shape, unknown or missing input, an id outside its table under the model's
``on_invalid_id: error``) gets 400 with one line naming the input; it never reaches a merged
forward.  SIGTERM (or Ctrl-C) stops accepting connections and answers every request already
received before the process exits.  :func:`~.processes.start_processes`: more server processes on the same
port (``SO_REUSEPORT``), each with its own model, queue and metrics.

The model comes from :func:`~dlrmctl.inference.export.load_exported` (either artifact kind,
``model.pt2`` or TorchScript ``model.pt``; the manifest's SHA-256 checked).
"""
