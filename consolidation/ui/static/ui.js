// The dashboard's only script: reload <main> from the server every few seconds, and perform the
// buttons' actions by calling the /v1 API itself (same guard, same validation as any client),
// after a confirmation where the button asks for one.
"use strict";

(() => {
  const main = document.getElementById("main");
  const dialog = document.getElementById("confirm");
  const flashBox = document.getElementById("flash");
  if (!main || !dialog || !flashBox) return;
  let awaiting = null; // the button whose action waits for the confirmation
  let busy = false;

  function flash(text, kind) {
    const item = document.createElement("div");
    item.className = `flash ${kind}`;
    item.textContent = text;
    flashBox.replaceChildren(item);
    setTimeout(() => item.remove(), kind === "error" ? 10000 : 5000);
  }

  async function refresh() {
    if (busy || dialog.open) return;
    busy = true;
    try {
      const response = await fetch(location.href, {
        credentials: "same-origin",
        cache: "no-store",
        headers: { Accept: "text/html" },
      });
      if (response.redirected) {
        location.assign(response.url); // the session ended: the key form
        return;
      }
      if (!response.ok) return;
      const doc = new DOMParser().parseFromString(await response.text(), "text/html");
      const fresh = doc.getElementById("main");
      if (fresh && !dialog.open) main.innerHTML = fresh.innerHTML;
    } catch (error) {
      // The service is restarting or unreachable: keep the last page, try again later.
    } finally {
      busy = false;
    }
  }

  const every = Number(main.dataset.refresh || 0);
  if (every > 0) {
    const tick = async () => {
      if (!document.hidden) await refresh();
      setTimeout(tick, every);
    };
    setTimeout(tick, every);
  }

  function describe(kind, body) {
    if (kind === "cancel") {
      return body.status === "running"
        ? "Cancel requested: the operation stops within about a second."
        : `The operation is ${body.status}.`;
    }
    if (kind === "recover") {
      const n = body.recovered;
      return `${n} failed ${n === 1 ? "memory" : "memories"} will be consolidated again.`;
    }
    if (kind === "retry") {
      const id = String(body.operation_id).slice(0, 8);
      return body.deduplicated
        ? `Joined the pending operation ${id}.`
        : `Operation ${id} enqueued to retry.`;
    }
    if (kind === "consolidate") {
      const id = String(body.operation_id).slice(0, 8);
      return body.deduplicated
        ? `Joined the pending operation ${id}.`
        : `Operation ${id} enqueued.`;
    }
    return "Done.";
  }

  async function perform(button) {
    const [method, url] = button.dataset.action.split(" ");
    const headers = { Accept: "application/json" };
    const init = { method, credentials: "same-origin", headers };
    if (button.dataset.body) {
      headers["Content-Type"] = "application/json";
      init.body = button.dataset.body;
    }
    button.disabled = true;
    try {
      const response = await fetch(url, init);
      const body = await response.json().catch(() => ({}));
      if (response.ok) {
        flash(describe(button.dataset.kind, body), "ok");
      } else {
        const error = body && body.error ? body.error.message : response.statusText;
        flash(`${response.status}: ${error}`, "error");
      }
    } catch (error) {
      flash(`The request failed: ${error}`, "error");
    } finally {
      button.disabled = false;
    }
    await refresh();
  }

  document.addEventListener("click", (event) => {
    const button = event.target.closest("button[data-action]");
    if (!button) return;
    event.preventDefault();
    if (!button.dataset.confirm) {
      perform(button);
      return;
    }
    awaiting = button;
    dialog.querySelector(".message").textContent = button.dataset.confirm;
    const yes = dialog.querySelector("#confirm-yes");
    yes.textContent = button.dataset.confirmLabel || "Confirm";
    yes.className = button.dataset.confirmStyle === "primary" ? "" : "danger";
    dialog.returnValue = "";
    dialog.showModal();
  });

  dialog.addEventListener("close", () => {
    const button = awaiting;
    awaiting = null;
    if (button && dialog.returnValue === "confirm") perform(button);
  });
})();
