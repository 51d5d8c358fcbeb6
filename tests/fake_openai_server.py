"""A stand-in for vLLM's OpenAI-compatible server, for ``tests/test_vllm_online.py``: ``/health``,
``/v1/models`` and ``/v1/completions`` (token-id prompts, ``logprobs=k``, streamed or not), in
the shape vLLM sends with ``return_tokens_as_token_ids``.

Deterministic answers from the prompt; with ``--variant`` every log-probability also depends on
how many requests are in flight when the token is made (a batch-variant server: the negative
control).  Streamed tokens are spaced by ``--token-s`` seconds, so that a client can cancel
mid-flight; the server counts the streams whose client went away (``/stats``).

    python tests/fake_openai_server.py --port P [--variant] [--token-s 0.02] [--start-s 0]
"""
import argparse
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

STATE = {"in_flight": 0, "aborted": 0, "served": 0}
LOCK = threading.Lock()


def answer(prompt, n, k, variant):
    toks, lps, tops = [], [], []
    base = sum(prompt)
    for i in range(n):
        t = (base + 7 * i) % 97 + 2
        lp = -((base + i) % 13 + 1) / 8
        if variant:
            with LOCK:
                lp -= (STATE["in_flight"] - 1) * 2 ** -20
        toks.append(f"token_id:{t}")
        lps.append(lp)
        tops.append({f"token_id:{t + j}": lp - j / 4 for j in range(k)})
    return toks, lps, tops


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def _json(self, code, doc):
        data = json.dumps(doc).encode()
        self.send_response(code)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/health":
            self._json(200, {})
        elif self.path == "/v1/models":
            self._json(200, {"data": [{"id": "model"}]})
        elif self.path == "/stats":
            self._json(200, STATE)
        else:
            self._json(404, {})

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["content-length"])))
        assert req["return_tokens_as_token_ids"] and req["temperature"] == 0.0 and req["ignore_eos"]
        with LOCK:
            STATE["in_flight"] += 1
        try:
            toks, lps, tops = answer(req["prompt"], req["max_tokens"], req["logprobs"], ARGS.variant)
            if not req.get("stream"):
                time.sleep(ARGS.token_s * len(toks))
                self._json(200, {"choices": [{"index": 0, "text": "", "finish_reason": "length", "logprobs": {
                    "tokens": toks, "token_logprobs": lps, "top_logprobs": tops,
                    "text_offset": list(range(len(toks)))}}]})
                return
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.end_headers()
            try:
                for i, (t, lp, top) in enumerate(zip(toks, lps, tops)):
                    time.sleep(ARGS.token_s)
                    chunk = {"choices": [{"index": 0, "text": "", "finish_reason": "length" if i == len(toks) - 1
                                          else None, "logprobs": {"tokens": [t], "token_logprobs": [lp],
                                                                  "top_logprobs": [top], "text_offset": [i]}}]}
                    self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                    self.wfile.flush()
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError):
                with LOCK:
                    STATE["aborted"] += 1
        finally:
            with LOCK:
                STATE["in_flight"] -= 1
                STATE["served"] += 1


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--variant", action="store_true")
    p.add_argument("--token-s", type=float, default=0.02)
    p.add_argument("--start-s", type=float, default=0.0)
    ARGS = p.parse_args()
    time.sleep(ARGS.start_s)
    ThreadingHTTPServer(("127.0.0.1", ARGS.port), Handler).serve_forever()
