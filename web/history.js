// The sidebar's list of saved conversations: open, rename in place, delete; export and import.

import * as store from "./store.js";

/**
 * Draw `items` (newest first) into `list`. `actions`: {open(id), rename(id, title), remove(id)}.
 * `current`: the id of the conversation on screen, marked with aria-current.
 */
export function renderList(list, items, current, actions) {
  const focused = document.activeElement && list.contains(document.activeElement)
    ? document.activeElement.dataset.focusKey : null;
  list.replaceChildren();
  for (const c of items) {
    const li = document.createElement("li");
    li.className = "conv";
    li.dataset.testid = "conversation-item";
    li.dataset.id = c.id;
    const open = li.appendChild(button("conv-open", c.title, `Open “${c.title}”`));
    open.dataset.focusKey = `open:${c.id}`;
    if (c.id === current) open.setAttribute("aria-current", "true");
    open.addEventListener("click", () => actions.open(c.id));
    const rename = li.appendChild(button("icon", "✎", `Rename “${c.title}”`));
    rename.dataset.action = "rename";
    rename.dataset.focusKey = `rename:${c.id}`;
    rename.addEventListener("click", () => startRename(li, c, actions));
    const del = li.appendChild(button("icon", "🗑", `Delete “${c.title}”`));
    del.dataset.action = "delete";
    del.dataset.focusKey = `delete:${c.id}`;
    del.addEventListener("click", () => actions.remove(c.id));
    list.appendChild(li);
  }
  if (focused) list.querySelector(`[data-focus-key="${CSS.escape(focused)}"]`)?.focus();
}

function button(className, text, label) {
  const b = document.createElement("button");
  b.type = "button";
  b.className = className;
  b.textContent = text;
  b.setAttribute("aria-label", label);
  b.title = label;
  return b;
}

/** Replace the title by a text box: Enter keeps the new title, Escape or leaving it cancels. */
function startRename(li, c, actions) {
  const input = document.createElement("input");
  input.className = "conv-rename";
  input.value = c.title;
  input.setAttribute("aria-label", "New title");
  li.replaceChildren(input);
  input.focus();
  input.select();
  let done = false;
  const finish = (keep) => {
    if (done) return;
    done = true;
    const title = input.value.trim();
    actions.rename(c.id, keep && title ? title : c.title);
  };
  input.addEventListener("keydown", (e) => {
    if (e.key === "Enter") {
      e.preventDefault();
      finish(true);
    } else if (e.key === "Escape") {
      e.preventDefault();
      e.stopPropagation();
      finish(false);
    }
  });
  input.addEventListener("blur", () => finish(true));
}

/** Save every conversation as a JSON file. */
export async function download() {
  const blob = new Blob([await store.exportAll()], { type: "application/json" });
  const a = document.createElement("a");
  a.href = URL.createObjectURL(blob);
  a.download = `streamsd-chats-${new Date().toISOString().slice(0, 10)}.json`;
  document.body.appendChild(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(a.href), 1000);
}

/** Read a JSON file chosen in `input` (type=file) into the store; resolves to how many. */
export async function upload(input) {
  const file = input.files && input.files[0];
  input.value = "";
  if (!file) return 0;
  return store.importAll(await file.text());
}
