"""One HTTP request driven straight through an ASGI app, without a server or a socket (the serve tests)."""

from __future__ import annotations


async def asgi_request(app, method: str, path: str, body: bytes = b"",
                       headers=()) -> tuple[int, dict[str, str], bytes]:
    """``(status, response headers, response body)`` of one request to ``app``; ``headers`` are
    ``(name, value)`` string pairs."""
    sent, chunks = [], [{"type": "http.request", "body": body, "more_body": False}]

    async def receive():
        return chunks.pop(0) if chunks else {"type": "http.disconnect"}

    async def send(msg):
        sent.append(msg)

    scope = {"type": "http", "method": method, "path": path, "headers": [(k.encode(), v.encode()) for k, v in headers],
             "query_string": b"", "asgi": {"version": "3.0"}, "http_version": "1.1", "scheme": "http",
             "server": ("127.0.0.1", 1), "client": ("127.0.0.1", 2), "root_path": ""}
    await app(scope, receive, send)
    assert sent and sent[0]["type"] == "http.response.start", sent
    return (sent[0]["status"], {k.decode(): v.decode() for k, v in sent[0]["headers"]},
            b"".join(m.get("body", b"") for m in sent[1:]))
