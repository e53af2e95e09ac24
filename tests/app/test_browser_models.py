"""In a real browser (tests/app/browser_session.py): the Models tab. Downloads from a local fake hub, each with
its Cancel and Delete button; the load form's estimate and its word for a path that does not exist."""

import os

import pytest

from tests.app import browser_session
from tests.app.app_process import AppProcess
from tests.app.browser_session import shot, wait_for_js

# browser_session's fixtures: an app process and a browser, a tab on the app, the app's log after a failed test
session, open_page, app_log_on_failure = (
    browser_session.session,
    browser_session.open_page,
    browser_session.app_log_on_failure,
)

# Starting the apps and a browser on the bundled model takes minutes on a loaded 2-core machine.
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def hub_app(bundled_model, tmp_path_factory):
    """An app whose downloads come from a local fake hub: a small repo, and a big one served slowly enough to
    cancel."""
    import json

    from tests.app.fake_hub import FakeHub
    from tests.app.hub_fixtures import CONFIG

    home = tmp_path_factory.mktemp("hub_app")
    weights = {"config.json": json.dumps(CONFIG).encode(), "tokenizer.json": b'{"model": {"type": "BPE"}}'}
    hub = FakeHub(chunk_size=32 * 1024, throttle=0.1)
    hub.add_repo("pagoda-test/small-chat", {**weights, "model.safetensors": os.urandom(64 * 1024)})
    hub.add_repo("pagoda-test/big-chat", {**weights, "model.safetensors": os.urandom(8 * 1024 * 1024)})
    hub.start()
    app = AppProcess(
        bundled_model,
        home,
        env={
            "HF_HUB_OFFLINE": "0",
            "HF_ENDPOINT": hub.url,
            "HF_HUB_CACHE": str(home / "hub"),
            "HF_HUB_DISABLE_XET": "1",
        },
    )
    client = app.start()
    yield app, home / "hub", client
    app.kill()
    hub.stop()


def test_models_tab_cancel_and_delete_are_buttons_on_each_row(session, hub_app):
    """Cancel and delete wanted a typed repo id; each download and each downloaded model now has its button."""
    app, cache, client = hub_app
    page = session[2].new_page(viewport={"width": 1280, "height": 900})
    try:
        page.goto(app.url)
        page.locator("#context-meter").get_by_text("Context:").wait_for()
        page.get_by_role("tab", name="Models").click()

        def download(repo_id: str) -> None:
            field = page.locator("#model-choice input")
            field.fill(repo_id)
            field.press("Enter")
            page.get_by_role("button", name="Download", exact=True).click()

        download("pagoda-test/small-chat")
        small = page.locator(".model-row").filter(has_text="pagoda-test/small-chat")
        small.wait_for(timeout=60000)
        download("pagoda-test/big-chat")
        big = page.locator(".download-row").filter(has_text="pagoda-test/big-chat")
        big.get_by_role("button", name="Cancel").click(timeout=30000)
        wait_for_js(
            page,
            "() => [...document.querySelectorAll('.download-row')].some(r => "
            "r.innerText.includes('big-chat') && r.innerText.includes('cancelled'))",
            timeout=30000,
        )
        assert big.get_by_role("button", name="Cancel").count() == 0  # nothing left to cancel
        assert page.locator(".model-row").filter(has_text="pagoda-test/big-chat").count() == 0

        asked = []  # the browser asks first; the answer is no
        page.once("dialog", lambda dialog: (asked.append(dialog.message), dialog.dismiss()))
        small.get_by_role("button", name="Delete").click()
        for _ in range(200):  # the handler runs while Playwright waits (20 s at most)
            if asked:
                break
            page.wait_for_timeout(100)
        assert asked and "pagoda-test/small-chat" in asked[0]
        assert (cache / "models--pagoda-test--small-chat").exists() and small.count() == 1
        page.once("dialog", lambda d: d.accept())
        small.get_by_role("button", name="Delete").click()
        wait_for_js(
            page,
            "() => ![...document.querySelectorAll('.model-row')].some(r => r.innerText.includes('small-chat'))",
            timeout=20000,
        )
        assert not (cache / "models--pagoda-test--small-chat").exists()
        shot(page, "models-rows.png")

        # Scripts do the same by repo id.
        download("pagoda-test/big-chat")
        big.get_by_role("button", name="Cancel").wait_for(timeout=30000)
        assert client.predict("pagoda-test/big-chat", api_name="/cancel_download").startswith("Cancelling 1 ")
        wait_for_js(
            page,
            "() => ![...document.querySelectorAll('.download-row')].some(r => "
            "r.innerText.includes('big-chat') && r.innerText.includes('running'))",
            timeout=30000,
        )
        download("pagoda-test/small-chat")
        small.wait_for(timeout=60000)
        assert "Free disk" in client.predict("pagoda-test/small-chat", api_name="/delete_model")
        assert not (cache / "models--pagoda-test--small-chat").exists()
    finally:
        page.close()


def test_the_models_form_names_the_dtype_it_loads_and_says_when_a_path_does_not_exist(session, open_page):
    """The estimate said float32 while loads used bfloat16, the context started at 4,096 where the model serves
    8,192, the KV field showed 0, and a missing path said "press Download first"."""
    import torch

    from engine.loader import pick_dtype

    page = open_page()
    page.get_by_role("tab", name="Models").click()
    context = page.get_by_label("Context length (tokens)")
    context.wait_for()
    assert context.input_value() == "8192"  # the bundled model's own length, which fits here
    assert page.get_by_label("KV cache memory on a CPU, GiB").input_value() == "1"
    model = page.locator("#model-choice input")
    model.fill("SmolLM2 360M Instruct")
    page.get_by_role("option", name="SmolLM2 360M Instruct").first.click()
    quant = page.locator("#quantization input")
    quant.click()
    page.get_by_role("option", name="none", exact=True).click()
    expected = str(pick_dtype("auto", torch.device("cpu"), False)).removeprefix("torch.")
    wait_for_js(
        page,
        "() => document.querySelector('#fit-estimate').innerText.includes('"
        f"{expected}') && document.querySelector('#fit-estimate').innerText.includes('360M')",
        timeout=20000,
    )
    model.fill("/no/such/model/folder")
    model.press("Enter")
    page.get_by_role("button", name="Load", exact=True).click()
    wait_for_js(
        page, "() => document.body.innerText.includes('There is no model folder or .gguf file at')", timeout=20000
    )
    assert "press Download first" not in page.locator("body").inner_text()
    page.close()
