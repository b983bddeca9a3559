"""Drives the console in headless Chromium as an operator would (scripts/console-check runs it).

The overview shows the blocked key -> open its dead letter -> replay it with a reason (the
preview lists exactly its id, then confirm) -> the key's messages are published in order (read
back from the emulator's ordered subscription) -> the audit trail shows the replay with the
identity. A screenshot of each step goes to the output folder. Exits non-zero on the first
thing that is not as it should be.

With --scale (an incident: thousands of keys blocked, a large backlog, seeded by the caller) it
loads the overview in the browser several times and measures what a person waits for: the
page's size and the browser's load time (navigation start to the load event), each printed; it
fails when the median load takes longer than MAX_SECONDS or the page grew past MAX_KIB.

Usage: console_check.py CONSOLE_URL PUBSUB_API SUBSCRIPTION KEY IDENTITY OUT_DIR EXPECTED...
  EXPECTED: the key's dedupe keys in the order they must arrive.
       console_check.py --scale CONSOLE_URL OUT_DIR BLOCKED_KEYS MAX_SECONDS MAX_KIB
"""

import base64
import json
import sys
import time
import urllib.request

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By


def fail(message):
    print(f"console-check: FAIL: {message}", file=sys.stderr)
    sys.exit(1)


def step(message):
    print(f"console-check: {message}", file=sys.stderr)


def pull(api, subscription, want, timeout):
    """Pulls and acks until `want` messages arrived or `timeout` seconds passed."""
    got = []
    deadline = time.time() + timeout
    while len(got) < want and time.time() < deadline:
        body = json.dumps({"maxMessages": 100, "returnImmediately": True}).encode()
        req = urllib.request.Request(
            f"{api}/subscriptions/{subscription}:pull",
            data=body,
            headers={"content-type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            answer = json.load(r)
        received = answer.get("receivedMessages", [])
        if not received:
            time.sleep(0.3)
            continue
        got.extend(m["message"] for m in received)
        ack = json.dumps({"ackIds": [m["ackId"] for m in received]}).encode()
        urllib.request.urlopen(
            urllib.request.Request(
                f"{api}/subscriptions/{subscription}:acknowledge",
                data=ack,
                headers={"content-type": "application/json"},
            ),
            timeout=10,
        ).read()
    return got


def chromium():
    """Headless Chromium as this machine runs it (no background networking)."""
    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for flag in [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        "--window-size=1280,1400",
    ]:
        options.add_argument(flag)
    browser = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
    browser.set_page_load_timeout(30)
    # A click on a form's button returns before the next page has loaded: each lookup waits
    # (up to 10 s) for its element to appear rather than reading the page being left.
    browser.implicitly_wait(10)
    return browser


def scale(url, out, blocked_keys, max_seconds, max_kib):
    """The overview at incident scale, in the browser: size and load time, five loads."""
    browser = chromium()
    try:
        # The overview shows `status` as of at most two reads ago (it says how old): the seed
        # lands between reads, so the count shows once the console has read it again.
        deadline = time.time() + 60
        while True:
            browser.get(url + "/")
            text = browser.find_element(By.ID, "blocked-keys").text
            if str(blocked_keys) in text:
                break
            if time.time() > deadline:
                fail(f"the overview does not count the {blocked_keys} blocked keys: {text[:300]!r}")
            time.sleep(0.5)
        loads, size = [], 0
        for _ in range(5):
            browser.get(url + "/")
            timing = browser.execute_script(
                "const t = performance.getEntriesByType('navigation')[0];"
                "return [t.loadEventEnd - t.startTime, t.transferSize, t.decodedBodySize];"
            )
            text = browser.find_element(By.ID, "blocked-keys").text
            if str(blocked_keys) not in text:
                fail(f"the overview does not count the {blocked_keys} blocked keys: {text[:300]!r}")
            loads.append(timing[0] / 1000.0)
            size = timing[2]
        browser.save_screenshot(f"{out}/scale-overview.png")
        loads.sort()
        median = loads[len(loads) // 2]
        print(
            f"console-check: overview at {blocked_keys} blocked keys: {size / 1024:.1f} KiB, "
            f"browser load {median:.3f} s median ({', '.join(f'{x:.3f}' for x in loads)})"
        )
        if size > max_kib * 1024:
            fail(f"the overview is {size / 1024:.1f} KiB, over {max_kib} KiB")
        if median > max_seconds:
            fail(f"the overview takes {median:.3f} s to load in the browser, over {max_seconds} s")
    finally:
        browser.quit()


def main():
    if sys.argv[1] == "--scale":
        url, out, blocked, max_seconds, max_kib = sys.argv[2:7]
        return scale(url, out, int(blocked), float(max_seconds), float(max_kib))
    url, api, subscription, key, identity, out = sys.argv[1:7]
    expected = sys.argv[7:]
    browser = chromium()
    shots = 0

    def shot(name):
        nonlocal shots
        shots += 1
        browser.save_screenshot(f"{out}/{shots:02d}-{name}.png")

    try:
        step("overview: the blocked key")
        browser.get(url + "/")
        if browser.find_element(By.ID, "identity").text != identity:
            fail(f"the identity shown is {browser.find_element(By.ID, 'identity').text!r}")
        blocked = browser.find_element(By.ID, "blocked-keys")
        if key not in blocked.text:
            fail(f"the overview does not show the blocked key {key}: {blocked.text!r}")
        shot("overview")

        step("open its dead letter")
        blocked.find_element(By.CSS_SELECTOR, "a.dead-letter").click()
        held = browser.find_element(By.ID, "held").text
        if int(held) != len(expected) - 1:
            fail(f"the dead letter says {held} messages wait behind it, not {len(expected) - 1}")
        shot("dead-letter")

        step("replay: the preview")
        browser.find_element(By.ID, "replay").click()
        ids = browser.find_element(By.ID, "ids").text.split()
        if len(ids) != 1:
            fail(f"the preview lists {ids}, not exactly the one dead letter")
        browser.find_element(By.ID, "reason").send_keys("schema fixed upstream, INC-4711")
        shot("preview")

        step("replay: confirm")
        browser.find_element(By.ID, "apply").click()
        done = browser.find_element(By.ID, "done").text
        if "replay done" not in done or identity not in done:
            fail(f"the result page says {done!r}")
        shot("done")

        step("the key's messages are published in order")
        messages = pull(api, subscription, len(expected), 60)
        arrived = [m.get("attributes", {}).get("dedupe_key") for m in messages]
        if arrived != expected:
            fail(f"arrived {arrived}, expected {expected} in that order")
        payloads = [base64.b64decode(m.get("data", "")).decode() for m in messages]
        step(f"arrived in order: {arrived} ({payloads[0]} first)")

        step("the audit trail")
        browser.get(url + "/audit")
        audit = browser.find_element(By.ID, "audit").text
        if "replay" not in audit or identity not in audit or "INC-4711" not in audit:
            fail(f"the audit trail lacks the replay by {identity}: {audit!r}")
        shot("audit")

        browser.get(url + "/")
        shot("overview-after")
    except Exception:
        # What the browser had in front of it when a step failed.
        browser.save_screenshot(f"{out}/failed.png")
        with open(f"{out}/failed.html", "w") as page:
            page.write(browser.page_source)
        print(f"console-check: the page at failure ({browser.current_url}): {out}/failed.png, failed.html", file=sys.stderr)
        raise
    finally:
        browser.quit()
    print(f"console-check: PASS ({shots} screenshots in {out})")


if __name__ == "__main__":
    main()
