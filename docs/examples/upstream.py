#!/usr/bin/env python3
"""A stand-in API for docs/finding-abusers.md: POST /login answers 401 unless the
form says password=secret; every other request answers 200 with a short JSON body.
Usage: python3 docs/examples/upstream.py [PORT] (default 3000)."""
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Api(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def answer(self, status, body):
        data = body.encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self.answer(200, '{"items":[]}\n')

    def do_POST(self):
        length = int(self.headers.get("content-length") or 0)
        form = self.rfile.read(length).decode(errors="replace")
        if self.path == "/login" and "password=secret" not in form.split("&"):
            self.answer(401, '{"error":"bad credentials"}\n')
        else:
            self.answer(200, '{"ok":true}\n')

    def log_message(self, *args):
        pass


port = int(sys.argv[1]) if len(sys.argv) > 1 else 3000
ThreadingHTTPServer(("127.0.0.1", port), Api).serve_forever()
