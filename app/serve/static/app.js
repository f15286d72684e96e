// prefixrag chat page: keeps the conversation (in this browser too: it survives a reload until "New chat"),
// streams answers from /v1/chat/completions (SSE) one question at a time, with a Stop button that aborts the
// request, shows the sources (each opens to its snippet; citations in the answer link to them) and the
// cached-token count under each answer, and shows every error in the conversation. Where the key may read
// several collections, a picker chooses the model (a collection each) that answers.
"use strict";
const log = document.getElementById("log");
const form = document.getElementById("ask");
const input = document.getElementById("question");
const send = document.getElementById("send");
const stop = document.getElementById("stop");
const keyInput = document.getElementById("api-key");
const modelSelect = document.getElementById("model");
const SAVED = "prefixrag-chat";
let turns = [];  // {role, content, sources?, usage?}: what the page shows and the API is sent
let asking = null;  // the AbortController of the answer streaming now (one at a time)

keyInput.value = localStorage.getItem("prefixrag-key") || "";
keyInput.addEventListener("change", () => { localStorage.setItem("prefixrag-key", keyInput.value); listModels(); });
modelSelect.addEventListener("change", () => localStorage.setItem("prefixrag-model", modelSelect.value));

async function listModels() {  // the models this key may use; the picker shows only when there is a choice
  const headers = keyInput.value ? { Authorization: `Bearer ${keyInput.value}` } : {};
  const response = await fetch("/v1/models", { headers }).catch(() => null);
  const models = response && response.ok ? (await response.json()).data.map(({ id }) => id) : [];
  const chosen = localStorage.getItem("prefixrag-model");
  modelSelect.replaceChildren(...models.map((id) => new Option(id, id, false, id === chosen)));
  document.getElementById("collection").hidden = models.length < 2;
}
listModels();
document.getElementById("new-chat").addEventListener("click", () => {
  if (asking) asking.abort();
  turns = []; localStorage.removeItem(SAVED); log.replaceChildren(); input.focus();
});
input.addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); if (!asking) form.requestSubmit(); }
});
stop.addEventListener("click", () => { if (asking) asking.abort(); });

function save() { localStorage.setItem(SAVED, JSON.stringify(turns)); }

function restore() {
  try { turns = JSON.parse(localStorage.getItem(SAVED) || "[]"); } catch { turns = []; }
  for (const t of turns) {
    const turn = addTurn(t.role, t.content);
    if (t.role === "assistant") showSources(turn, t.sources, t.usage);
    if (t.stopped) turn.classList.add("stopped");
  }
}

function addTurn(role, text) {
  const turn = document.createElement("section");
  turn.className = `turn ${role}`;
  turn.innerHTML = `<div class="who"></div><div class="text"></div>`;
  turn.querySelector(".who").textContent = role === "user" ? "you" : "prefixrag";
  if (role === "assistant") renderAnswer(turn.querySelector(".text"), text);
  else turn.querySelector(".text").textContent = text;
  log.appendChild(turn);
  log.scrollTop = log.scrollHeight;
  return turn;
}

// Each source opens to show its snippet; a citation [id] in the answer names a source's id (the id the prompt
// showed the model) and becomes a link that opens it.
function showSources(turn, sources, usage) {
  const byId = new Map();
  if (sources && sources.length) {
    const list = document.createElement("ol");
    list.className = "sources";
    for (const s of sources) {
      const item = document.createElement("li");
      const details = document.createElement("details");
      const summary = document.createElement("summary");
      const where = [s.headings, s.page ? `page ${s.page}` : ""].filter(Boolean).join(", ");
      summary.textContent = `${s.title || s.document} — [${s.id}]${where ? ` (${where})` : ""}`;
      const snippet = document.createElement("blockquote");
      snippet.className = "snippet";
      snippet.textContent = s.snippet;
      details.append(summary, snippet);
      item.appendChild(details);
      list.appendChild(item);
      if (!byId.has(s.id)) byId.set(s.id, details);
    }
    turn.appendChild(list);
  }
  linkCitations(turn.querySelector(".text"), byId);
  if (usage) {
    const meta = document.createElement("div");
    meta.className = "meta";
    meta.textContent = `cached tokens: ${usage.prompt_tokens_details.cached_tokens} of ${usage.prompt_tokens} prompt tokens`;
    turn.appendChild(meta);
  }
}

// Citations are linked in the text nodes of the rendered answer, never inside its markup.
function linkCitations(text, byId) {
  const walker = document.createTreeWalker(text, NodeFilter.SHOW_TEXT);
  const nodes = [];
  while (walker.nextNode()) if (/\[[^\[\]]+\]/.test(walker.currentNode.nodeValue)) nodes.push(walker.currentNode);
  for (const node of nodes) {
    const parts = node.nodeValue.split(/\[([^\[\]]+)\]/);  // odd indices: what was inside brackets
    node.replaceWith(...parts.map((part, i) => {
      if (i % 2 === 0 || !byId.has(part)) return document.createTextNode(i % 2 ? `[${part}]` : part);
      const link = document.createElement("a");
      link.href = "#";
      link.className = "cite";
      link.textContent = `[${part}]`;
      link.addEventListener("click", (e) => { e.preventDefault(); const d = byId.get(part); d.open = true; d.scrollIntoView({ block: "nearest" }); });
      return link;
    }));
  }
}

// An answer is markdown from the model, which may repeat whatever a document says: rendered, then sanitised.
function renderAnswer(element, markdown) {
  element.innerHTML = DOMPurify.sanitize(marked.parse(markdown, { gfm: true, breaks: true }));
}

function showError(turn, message) {
  turn.classList.add("error");
  const line = document.createElement("div");
  line.textContent = `Error: ${message}`;
  turn.querySelector(".text").appendChild(line);
}

async function ask(question) {
  turns.push({ role: "user", content: question });
  addTurn("user", question);
  const turn = addTurn("assistant", "");
  const text = turn.querySelector(".text");
  const headers = { "Content-Type": "application/json" };
  if (keyInput.value) headers.Authorization = `Bearer ${keyInput.value}`;
  const messages = turns.map(({ role, content }) => ({ role, content }));
  let answer = "", sources = null, usage = null;
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers, signal: asking.signal,
      body: JSON.stringify({ model: modelSelect.value || undefined, messages, stream: true,
                             stream_options: { include_usage: true } }),
    });
    if (!response.ok) {
      const body = await response.json().catch(() => ({}));
      throw new Error(body.error ? body.error.message : `HTTP ${response.status}`);
    }
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        const data = event.replace(/^data: /, "");
        if (data === "[DONE]") continue;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message);
        for (const choice of chunk.choices || []) {
          if (choice.delta && choice.delta.content) { answer += choice.delta.content; renderAnswer(text, answer); }
        }
        if (chunk.sources) sources = chunk.sources;
        if (chunk.usage) usage = chunk.usage;
      }
    }
    turns.push({ role: "assistant", content: answer, sources, usage });
    showSources(turn, sources, usage);
  } catch (err) {
    if (err.name === "AbortError" && answer) {  // stopped mid-answer: what came so far stays in the conversation
      turns.push({ role: "assistant", content: answer, stopped: true });
      turn.classList.add("stopped");
    } else {
      turns.pop();  // the question was not answered: let the user ask it again
      if (err.name === "AbortError") turn.remove(); else showError(turn, err.message);
    }
  }
  save();
}

form.addEventListener("submit", async (e) => {
  e.preventDefault();
  const question = input.value.trim();
  if (!question || asking) return;
  input.value = "";
  asking = new AbortController();
  send.disabled = true; stop.hidden = false;
  try { await ask(question); } finally { asking = null; send.disabled = false; stop.hidden = true; input.focus(); }
});

restore();
