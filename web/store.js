// Saved conversations, in this browser's IndexedDB (nothing leaves the machine).
//
// A conversation is one plain object: {id, title, created, updated, system, settings, turns},
// where each turn keeps the question, the reply's text and token segments, how it ended and its
// figures. Export and import use the same objects as JSON.

const DB_NAME = "streamsd";
const STORE = "conversations";
const FORMAT = "streamsd.conversations";

let opening = null;

function open() {
  if (!opening) {
    opening = new Promise((resolve, reject) => {
      const req = indexedDB.open(DB_NAME, 1);
      req.onupgradeneeded = () => {
        const store = req.result.createObjectStore(STORE, { keyPath: "id" });
        store.createIndex("updated", "updated");
      };
      req.onsuccess = () => resolve(req.result);
      req.onerror = () => reject(req.error);
    });
  }
  return opening;
}

async function run(mode, work) {
  const db = await open();
  return new Promise((resolve, reject) => {
    const tx = db.transaction(STORE, mode);
    const req = work(tx.objectStore(STORE));
    tx.oncomplete = () => resolve(req ? req.result : undefined);
    tx.onerror = () => reject(tx.error);
    tx.onabort = () => reject(tx.error);
  });
}

export function newId() {
  return `c${Date.now().toString(36)}${Math.random().toString(36).slice(2, 8)}`;
}

/** Every conversation, newest (last changed) first. */
export async function list() {
  const all = await run("readonly", (s) => s.getAll());
  return all.sort((a, b) => b.updated - a.updated);
}

export const get = (id) => run("readonly", (s) => s.get(id));
export const put = (conversation) => run("readwrite", (s) => s.put(conversation));
export const remove = (id) => run("readwrite", (s) => s.delete(id));

/** All conversations as one JSON document. */
export async function exportAll() {
  return JSON.stringify({ format: FORMAT, version: 1, conversations: await list() }, null, 1);
}

/** Add the conversations of an exported document (same ids replace); resolves to how many. */
export async function importAll(text) {
  const doc = JSON.parse(text);
  const items = Array.isArray(doc) ? doc : doc && doc.format === FORMAT ? doc.conversations : null;
  if (!Array.isArray(items)) throw new Error("not a streamsd conversations file");
  let n = 0;
  for (const c of items) {
    if (!c || typeof c.id !== "string" || !Array.isArray(c.turns)) continue;
    await put({
      id: c.id,
      title: String(c.title || "Imported chat"),
      created: Number(c.created) || Date.now(),
      updated: Number(c.updated) || Date.now(),
      system: typeof c.system === "string" ? c.system : "",
      settings: c.settings && typeof c.settings === "object" ? c.settings : null,
      turns: c.turns.filter((t) => t && typeof t.user === "string"),
    });
    n++;
  }
  return n;
}
