// edgespec's chat page: streams /v1/chat/completions and shows each answer's
// speculative-decoding stats. Plain DOM, no dependencies; text is only ever set with
// textContent, so nothing a model or a user writes is run as markup.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_STORE = "edgespec-api-key"; // this tab only: sessionStorage, not localStorage
const state = { model: null, history: [], controller: null, chat: true };
const NO_CHAT = "This model has no chat template, so this page cannot chat with it: send it " +
  "text to continue through /v1/completions, or serve a chat model.";

function setBusy(busy) {
  document.body.dataset.state = busy ? "streaming" : "idle";
  $("send").disabled = busy || !state.chat; // a model without a chat template never can
  $("stop").disabled = !busy;
}

function showError(message) {
  $("error").textContent = message;
  $("error").hidden = !message;
}

function addMessage(role, text) {
  const box = document.createElement("div");
  box.className = `message ${role}`;
  const who = document.createElement("div");
  who.className = "who";
  who.textContent = role;
  const body = document.createElement("div");
  body.className = "text";
  body.textContent = text;
  box.append(who, body);
  $("log").append(box);
  box.scrollIntoView({ block: "end" });
  return box;
}

function statsLine(s) {
  let line = `${s.new_tokens} tokens · ${s.tokens_per_second.toFixed(1)} tok/s · ` +
    `${s.tokens_per_target_pass.toFixed(2)} tokens/pass`;
  if (s.mode !== "ar") line += ` · acceptance ${Math.round(100 * s.acceptance_rate)}%`;
  return `${line} [${s.mode}, ${s.device}]`;
}

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

// `earlier`: the conversation has turns before this message
async function errorText(response, earlier) {
  if (response.status === 401) {
    return $("api-key").value.trim()
      ? "The server did not accept this API key: check it above."
      : "This server needs its API key: enter it above.";
  }
  try {
    const body = await response.json();
    if (!body.error) return `HTTP ${response.status}`;
    // too long for the model: a new chat, or a shorter message where it is the first
    const tail = body.error.code !== "context_length_exceeded" ? ""
      : earlier ? " This conversation is too long for the model: start a new chat."
        : " Shorten your message.";
    return body.error.message + tail;
  } catch {
    return `HTTP ${response.status}`;
  }
}

// fetch's own failures (no server, a dropped connection) are TypeErrors
function reachText(e) {
  return e instanceof TypeError ? `cannot reach the server (${e.message})` : e.message;
}

// Server-sent events: "data: {json}" blocks separated by a blank line.
async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { done, value } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of block.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}

async function ask(text) {
  showError("");
  // this conversation: "New chat" during the answer starts another, which it must not touch
  const history = state.history;
  history.push({ role: "user", content: text });
  const question = addMessage("user", text);
  const box = addMessage("assistant", "");
  const body = box.querySelector(".text");
  const stats = document.createElement("div");
  stats.className = "stats";
  box.append(stats);
  box.dataset.chunks = "0";
  const request = {
    model: state.model, messages: history, stream: true,
    temperature: Number($("temperature").value), max_tokens: Number($("max-tokens").value),
    mode: $("mode").value,
  };
  state.controller = new AbortController();
  setBusy(true);
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(request),
      signal: state.controller.signal,
    });
    if (!response.ok) throw new Error(await errorText(response, history.length > 1));
    for await (const chunk of events(response)) {
      if (chunk.error) throw new Error(chunk.error.message);
      const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
      if (delta && delta.content) {
        body.textContent += delta.content;
        box.dataset.chunks = String(Number(box.dataset.chunks) + 1);
        box.scrollIntoView({ block: "end" });
      }
      if (chunk.edgespec) stats.textContent = statsLine(chunk.edgespec);
    }
    history.push({ role: "assistant", content: body.textContent });
  } catch (e) {
    if (e.name === "AbortError" || body.textContent) {
      // stopped, or cut off mid-answer: what was said stays, marked
      stats.textContent = e.name === "AbortError" ? "stopped" : `interrupted: ${reachText(e)}`;
      stats.classList.add("stopped");
      history.push({ role: "assistant", content: body.textContent });
      if (e.name !== "AbortError") showError(reachText(e));
    } else {
      // nothing was answered: the question goes back to the input, to send again
      history.pop();
      question.remove();
      box.remove();
      if (!$("prompt").value) $("prompt").value = text;
      showError(reachText(e));
    }
  } finally {
    state.controller = null;
    setBusy(false);
  }
}

async function connect() {
  try {
    const response = await fetch("/health", { headers: headers() });
    const health = await response.json();
    state.model = health.model;
    $("model").textContent = `${health.model} on ${health.device}`;
    const spec = $("mode").querySelector("option[value=spec]");
    spec.disabled = !health.draft;
    $("mode").value = health.default_mode;
    $("key-label").hidden = !health.auth;
    state.chat = health.chat;
    setBusy(Boolean(state.controller));
    if (!health.chat) {
      showError(NO_CHAT);
    } else if (health.auth && !$("api-key").value) {
      showError("This server needs its API key: enter it above.");
    }
  } catch (e) {
    showError(`cannot reach the server (${e.message})`);
  }
}

// what is wrong with the settings fields, in one sentence, or ""
function settingsProblem() {
  if (!state.chat) return NO_CHAT;
  const temperature = $("temperature").value, tokens = $("max-tokens").value;
  if (temperature === "" || !(Number(temperature) >= 0 && Number(temperature) <= 2)) {
    return "Temperature must be a number from 0 (greedy) to 2.";
  }
  if (tokens === "" || !Number.isInteger(Number(tokens)) || Number(tokens) < 1) {
    return "Max tokens must be a whole number of at least 1.";
  }
  return "";
}

function init() {
  $("api-key").value = sessionStorage.getItem(KEY_STORE) || "";
  $("api-key").addEventListener("change", () => {
    sessionStorage.setItem(KEY_STORE, $("api-key").value.trim());
    showError("");
  });
  $("ask").addEventListener("submit", (event) => {
    event.preventDefault();
    const text = $("prompt").value; // as typed: pasted code keeps its indentation
    if (!text.trim() || state.controller) return;
    const problem = settingsProblem();
    if (problem) return showError(problem);
    $("prompt").value = "";
    ask(text);
  });
  $("prompt").addEventListener("keydown", (event) => {
    // Enter that confirms an input method's composition (Japanese, Chinese...) is not a send
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing && event.keyCode !== 229) {
      event.preventDefault();
      $("ask").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => state.controller && state.controller.abort());
  $("new-chat").addEventListener("click", () => {
    if (state.controller) state.controller.abort();
    state.history = [];
    $("log").replaceChildren();
    showError(state.chat ? "" : NO_CHAT); // a new chat cannot chat either
  });
  setBusy(false);
  connect();
}

document.addEventListener("DOMContentLoaded", init);
