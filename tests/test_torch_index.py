"""scripts/torch_index.py, make install's probe of PyTorch's CPU wheel index, against a server on this machine: the
index given to pip when it answers, nothing but one line on stderr when it cannot be reached (no network used)."""

from __future__ import annotations

import http.server
import socket
import threading

from scripts import torch_index


class Index(http.server.BaseHTTPRequestHandler):
    def do_HEAD(self):  # noqa: N802 - http.server's name
        self.send_response(200 if self.path == "/whl/cpu/torch/" else 404)
        self.end_headers()

    def log_message(self, *args):  # quiet: the test reads only the script's output
        pass


def test_the_index_goes_to_pip_when_it_answers_and_a_line_says_so_when_it_does_not(capsys, monkeypatch):
    for proxy in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"):  # the server is here, not behind a proxy
        monkeypatch.delenv(proxy, raising=False)
    server = http.server.HTTPServer(("127.0.0.1", 0), Index)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}/whl/cpu"
        assert torch_index.main([url + "/"]) == 0
        assert capsys.readouterr() == (f"--extra-index-url {url}\n", "")
        assert torch_index.main([f"http://127.0.0.1:{server.server_port}/elsewhere"]) == 0  # 404: not an index
        out, err = capsys.readouterr()
        assert out == "" and "cannot be reached (Not Found)" in err and len(err.splitlines()) == 1
    finally:
        server.shutdown()
        server.server_close()
    with socket.socket() as closed:  # a port nothing listens on: refused at once
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    assert torch_index.main([f"http://127.0.0.1:{port}"]) == 0
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"PyTorch's CPU wheel index http://127.0.0.1:{port} cannot be reached")
    assert torch_index.main(["--help"]) == 0 and "make install" in capsys.readouterr().out
