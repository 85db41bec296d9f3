"""serving.media: http(s) image URLs are fetched only from allow-listed hosts, redirects included, within the
size limit; every refusal names its flag. A local HTTP server stands in for the web."""

import http.server
import threading

import pytest

from serving import media
from serving.errors import ApiError

PNG = b"\x89PNG\r\n\x1a\n" + b"\0" * 100


@pytest.fixture(scope="module")
def web():
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            if self.path.startswith("/moved"):
                self.send_response(302)
                self.send_header("Location", f"http://localhost:{self.server.server_port}/cat.png")
                self.end_headers()
                return
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            self.wfile.write(PNG)

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_port}"
    srv.shutdown()


def test_allowed_host_is_fetched(web):
    assert media.image_bytes(web + "/cat.png", media.MediaConfig(allowed_media_domains=("127.0.0.1",)), 0) == PNG


@pytest.mark.parametrize("path, cfg, needle", [
    ("/cat.png", media.MediaConfig(), "--allowed-media-domains"),  # off by default
    ("/moved", media.MediaConfig(allowed_media_domains=("127.0.0.1",)), "--allowed-media-domains"),
    ("/cat.png", media.MediaConfig(max_image_bytes=50, allowed_media_domains=("127.0.0.1",)), "--max-image-bytes"),
])
def test_refusals_name_the_flag(web, path, cfg, needle):
    with pytest.raises(ApiError) as e:
        media.image_bytes(web + path, cfg, 0)
    assert e.value.status == 400 and needle in e.value.message
