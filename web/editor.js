// Editing a question in place: a text box over the bubble, Enter (or Send) sends, Escape cancels.

let nextId = 1;

/**
 * Show an editor for `text` in `message` (the user's message element), hiding `bubble` meanwhile.
 * `send(text)` returns true when it took the new text (the editor then closes); `cancel()` runs when
 * the user gives up.
 */
export function openEditor(message, bubble, text, { send, cancel }) {
  const form = document.createElement("form");
  form.className = "edit-form";
  const label = form.appendChild(document.createElement("label"));
  label.className = "visually-hidden";
  label.textContent = "Edit your question";
  const box = form.appendChild(document.createElement("textarea"));
  box.id = `edit-${nextId++}`;
  label.htmlFor = box.id;
  box.value = text;
  box.rows = Math.min(8, text.split("\n").length + 1);
  const row = form.appendChild(document.createElement("div"));
  row.className = "edit-actions";
  const no = row.appendChild(button("Cancel", "btn small", "button"));
  row.appendChild(button("Send", "btn small primary", "submit"));
  bubble.hidden = true;
  message.appendChild(form);
  box.focus();

  const close = () => {
    form.remove();
    bubble.hidden = false;
  };
  const submit = () => {
    const value = box.value.trim();
    if (value && send(value)) close();
  };
  form.addEventListener("submit", (e) => {
    e.preventDefault();
    submit();
  });
  no.addEventListener("click", () => {
    close();
    cancel();
  });
  box.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      submit();
    } else if (e.key === "Escape") {
      e.preventDefault();
      close();
      cancel();
    }
  });
}

function button(text, className, type) {
  const b = document.createElement("button");
  b.type = type;
  b.className = className;
  b.textContent = text;
  return b;
}
