"""The Chat tab: the chat, the message box and its buttons, the context meter, and the chat's system prompt
and sampling settings."""

from dataclasses import dataclass
from typing import TYPE_CHECKING

import gradio as gr

from app.chat_settings import ChatSettings
from app.page import user_error
from app.page.sidebar import RENAMES_SO_FAR_JS

if TYPE_CHECKING:
    from app.page.sidebar import Sidebar
    from app.ui import PagodaUI

SLIDERS = [  # setting, label, minimum, maximum, step; in the order PagodaUI.respond takes them
    ("temperature", "Temperature", 0.0, 2.0, 0.05),
    ("top_p", "Top-p", 0.05, 1.0, 0.05),
    ("top_k", "Top-k (-1 = off)", -1, 200, 1),
    ("min_p", "Min-p", 0.0, 1.0, 0.01),
    ("repetition_penalty", "Repetition penalty", 0.8, 2.0, 0.05),
    ("max_tokens", "Max reply tokens", 16, 4096, 16),
]
# Gradio's chatbot has a trash icon that clears only the view: the chat stays stored, is still sent to
# the model and comes back on reload. Gradio offers no switch for it, so the page hides it; New chat
# and Delete are the real ways.
CHAT_CSS = '#chatbot button[aria-label="Clear"] { display: none; }\n'
KEYS_JS = """
() => {
  document.addEventListener('keydown', (e) => {
    if (e.key === 'Escape') { document.querySelector('#stop-btn')?.click(); }
  });
  document.addEventListener('click', (e) => {
    const link = e.target.closest('#chatbot a[href^="#pagoda-"], #chat-files a[href^="#pagoda-"]');
    if (!link) { return; }
    e.preventDefault();
    e.stopPropagation();
    window.pagodaAction = link.getAttribute('href').slice('#pagoda-'.length);
    document.querySelector('#message-action')?.click();
  }, true);
}
"""  # runs as the page loads: Esc presses Stop, and the links under a message (‹ ›, ✎ edit, new chat from here) or a
# file (remove) act on it (PagodaUI.message_action) instead of being followed. Capture: the chatbot opens links in a
# new tab.
ACTION_JS = "(cid, action) => [cid, window.pagodaAction || '']"  # the link clicked last, as the action's input
DOWNLOAD_JS = """
(file) => {
  if (!file?.url) { return; }
  const link = document.createElement('a');
  link.href = file.url;
  link.download = file.orig_name || '';
  document.body.appendChild(link);
  link.click();
  link.remove();
}
"""  # the browser saves the file an Export button made


# The LaTeX the chatbot renders: display math between $$ (Gradio's default), and \(…\) and \[…\] as models write
# them. Not single $: the browser's KaTeX would read "$5 and $10" as math; app/markdown_text.py turns the `$…$`
# that are math into \(…\) instead.
MATH_DELIMITERS = [
    {"left": "$$", "right": "$$", "display": True},
    {"left": "\\(", "right": "\\)", "display": False},
    {"left": "\\[", "right": "\\]", "display": True},
]


@dataclass
class ChatTab:
    chatbot: gr.Chatbot
    overflow: gr.Markdown  # why a chat too long for the context was refused
    overflow_row: gr.Row
    drop_btn: gr.Button
    fresh_btn: gr.Button
    msg: gr.Textbox
    stop_btn: gr.Button
    regen_btn: gr.Button
    edit_row: gr.Row  # shown while a message is being edited (✎ under it)
    edit_note: gr.Markdown
    cancel_edit_btn: gr.Button
    files: gr.Markdown  # the chat's files, above the message box
    attach_btn: gr.UploadButton
    file_choice_row: gr.Row  # a file too big for the context: keep its start, or leave it out
    file_choice_note: gr.Markdown
    keep_start_btn: gr.Button
    leave_out_btn: gr.Button
    action: gr.Textbox  # carries a message link's action (ACTION_JS) to the hidden button that sends it
    action_btn: gr.Button
    md_btn: gr.Button
    json_btn: gr.Button
    export_file: gr.File  # the file an Export button just made, which the browser then downloads
    meter: gr.Markdown
    think: gr.Checkbox
    json_output: gr.Checkbox
    json_schema: gr.Code
    preset: gr.Dropdown
    system: gr.Textbox
    system_of: gr.Number  # the chat whose system prompt the box shows: set with the box, so the two always agree
    preset_name: gr.Textbox
    save_preset_btn: gr.Button
    sliders: list[gr.Slider]


def render_chat_tab(presets: dict[str, str]) -> ChatTab:
    default = ChatSettings()  # what a new chat starts with
    chatbot = gr.Chatbot(height=480, label="Chat", elem_id="chatbot", latex_delimiters=MATH_DELIMITERS)
    overflow = gr.Markdown(visible=False)
    with gr.Row(visible=False) as overflow_row:
        drop_btn = gr.Button("Drop the oldest turn", size="sm")
        fresh_btn = gr.Button("Start a new chat", size="sm")
    with gr.Row(visible=False, elem_id="edit-note") as edit_row:
        edit_note = gr.Markdown()
        cancel_edit_btn = gr.Button("Cancel edit", size="sm", scale=0, min_width=120)
    files = gr.Markdown(elem_id="chat-files")
    with gr.Row(visible=False, elem_id="file-choice") as file_choice_row:
        file_choice_note = gr.Markdown()
        keep_start_btn = gr.Button("Keep its start", size="sm", scale=0, min_width=140)
        leave_out_btn = gr.Button("Leave it out", size="sm", scale=0, min_width=120)
    action = gr.Textbox(visible=False)
    action_btn = gr.Button(visible="hidden", elem_id="message-action")
    msg = gr.Textbox(
        placeholder="Message (Enter sends, Shift+Enter for a new line)",
        lines=1,
        max_lines=10,
        show_label=False,
        elem_id="message",
        submit_btn=True,
    )
    with gr.Row():
        stop_btn = gr.Button("Stop (Esc)", size="sm", elem_id="stop-btn")
        regen_btn = gr.Button("Regenerate", size="sm")
        attach_btn = gr.UploadButton(
            "Attach files", size="sm", file_count="multiple", elem_id="attach", file_types=None
        )
        md_btn = gr.Button("Export Markdown", size="sm")
        json_btn = gr.Button("Export JSON", size="sm")
    export_file = gr.File(visible="hidden", elem_id="export-file")
    meter = gr.Markdown(elem_id="context-meter")
    with gr.Row():
        # Shown once a model that reasons serves (PagodaUI.think_switch)
        think = gr.Checkbox(
            default.think,
            label="Think",
            elem_id="think",
            visible=False,
            info="Models that reason (Qwen3, DeepSeek-R1 distills) think before they answer",
        )
        json_output = gr.Checkbox(
            default.json_output,
            label="JSON output",
            elem_id="json-output",
            info="Replies are JSON objects; give a schema to hold them to it",
        )
    json_schema = gr.Code(
        default.json_schema,
        language="json",
        label="JSON schema (optional)",
        visible=default.json_output,
        elem_id="json-schema",
        lines=4,
    )
    with gr.Accordion("System prompt and sampling", open=False):
        preset = gr.Dropdown(choices=list(presets), label="Preset (shared by all chats)", value=None)
        system = gr.Textbox(label="System prompt", lines=3, elem_id="system-prompt")
        system_of = gr.Number(visible=False, precision=0)
        with gr.Row():
            preset_name = gr.Textbox(label="Save as preset", placeholder="Preset name", scale=3)
            save_preset_btn = gr.Button("Save preset", size="sm", scale=1)
        sliders = [
            gr.Slider(lo, hi, value=getattr(default, k), step=step, label=label) for k, label, lo, hi, step in SLIDERS
        ]
    return ChatTab(
        chatbot,
        overflow,
        overflow_row,
        drop_btn,
        fresh_btn,
        msg,
        stop_btn,
        regen_btn,
        edit_row,
        edit_note,
        cancel_edit_btn,
        files,
        attach_btn,
        file_choice_row,
        file_choice_note,
        keep_start_btn,
        leave_out_btn,
        action,
        action_btn,
        md_btn,
        json_btn,
        export_file,
        meter,
        think,
        json_output,
        json_schema,
        preset,
        system,
        system_of,
        preset_name,
        save_preset_btn,
        sliders,
    )


def wire_chat_tab(ui: "PagodaUI", tab: ChatTab, bar: "Sidebar", presets: dict[str, str]):
    """The Chat tab's events. Opening a chat in the sidebar (`bar.current`) fills the tab and follows its reply;
    saving a preset adds it to `presets`. Returns the event of a link under a message, for what redraws after it."""
    # The chat keeps its system prompt as it is typed or picked, and the meter counts it. Saved for the chat the box
    # shows (`system_of`), not the open chat's id: that one changes an event before the box does, on a switch.
    # "always_last": one save at a time, then the latest text; blur saves at once when the user clicks away.
    save = dict(fn=ui.save_system_prompt, inputs=[tab.system_of, tab.system], outputs=tab.meter, show_progress="hidden")
    tab.system.input(**save, trigger_mode="always_last")
    tab.system.blur(**save, trigger_mode="multiple")
    tab.preset.change(lambda name: presets.get(name, ""), tab.preset, tab.system).then(**save)

    def save_preset(name, prompt):
        if not name.strip():
            raise user_error("Give the preset a name.")
        ui.store.save_preset(name.strip(), prompt)
        presets[name.strip()] = prompt
        return gr.update(choices=list(presets), value=name.strip()), ""

    tab.save_preset_btn.click(save_preset, [tab.preset_name, tab.system], [tab.preset, tab.preset_name])

    options = [tab.think, tab.json_output, tab.json_schema]
    opened = [tab.chatbot, tab.system, tab.system_of, *tab.sliders, tab.meter, bar.title, *options]
    reply_outputs = [tab.chatbot, tab.msg, tab.overflow, tab.overflow_row, tab.meter, tab.edit_row]
    reply_inputs = [bar.current, tab.msg, tab.system, *tab.sliders]
    refresh = dict(fn=ui.after_reply, inputs=bar.current, outputs=[tab.meter, bar.conversations])
    limit = ui.max_concurrent_chats
    # No status overlay on a reply's outputs: the streaming text shows progress itself, and an overlay
    # left on the message box (a reply whose following was cancelled by switching chats could leave
    # one saying "Error") would block typing the next message. gr.Error still shows as a toast.
    quiet = dict(concurrency_limit=limit, concurrency_id="reply", show_progress="hidden")
    # "multiple": Gradio's default for submit ("once") dropped an Enter pressed while the chat answered, without
    # a word; now respond runs and says why it cannot send yet, and the message stays in the box.
    send = tab.msg.submit(ui.respond, reply_inputs, reply_outputs, api_name="respond", trigger_mode="multiple", **quiet)
    send.then(**refresh)
    regen = tab.regen_btn.click(
        ui.regenerate, [bar.current, tab.system, *tab.sliders], reply_outputs, api_name="regenerate", **quiet
    )
    regen.then(**refresh)
    # Opening a chat stops following the previous one (its reply runs on) and follows this one's.
    opening = bar.current.change(ui.open, bar.current, opened, cancels=[send, regen])
    opening.then(lambda on: gr.update(visible=on), tab.json_output, tab.json_schema)
    # `input`, not `change`: only what the user sets is saved, never the values a chat switch puts in
    for option in options:
        option.input(ui.set_chat_options, [bar.current, *options], None)
    tab.json_output.input(lambda on: gr.update(visible=on), tab.json_output, tab.json_schema)
    follow = opening.then(ui.follow, bar.current, reply_outputs, **quiet)
    opening.then(ui.cancel_edit, None, tab.edit_row)  # an edit belongs to the chat it began in
    opening.then(ui.files_view, bar.current, tab.files).then(ui.discard_pending, None, tab.file_choice_row)
    # Files are read and attached at once; one too big for the context waits for the user's choice
    tab.attach_btn.upload(
        ui.attach_files,
        [bar.current, tab.attach_btn],
        [tab.files, tab.meter, tab.file_choice_row, tab.file_choice_note],
        api_visibility="private",
    )
    tab.keep_start_btn.click(ui.keep_start, bar.current, [tab.files, tab.meter, tab.file_choice_row])
    tab.leave_out_btn.click(ui.discard_pending, None, tab.file_choice_row)
    # ‹ › switch branches, ✎ edit puts a message in the box (stopping the chat's reply, which then draws no more),
    # "new chat from here" opens a copy of the chat down to the message
    acted = tab.action_btn.click(
        ui.message_action,
        [bar.current, tab.action],
        [tab.chatbot, tab.msg, tab.edit_row, tab.edit_note, tab.meter, bar.conversations, tab.files],
        js=ACTION_JS,
        show_progress="hidden",
        api_visibility="private",
    )
    tab.cancel_edit_btn.click(ui.cancel_edit, None, tab.edit_row, show_progress="hidden")
    tab.stop_btn.click(
        ui.stop_and_show, bar.current, [tab.chatbot, tab.meter], cancels=[send, regen, follow], api_name="stop"
    )

    # The file is made at the click, from the chat chosen in the list: made when a chat opened, a click just
    # after a switch (the chat still opening) or a rename downloaded the chat before, or the old title. The list's
    # choice is read as the page has it (no preprocessing), as its own change does; `current` lags it by an event.
    def export(kind: str):
        def made(chosen, opened, renames, request: gr.Request):
            return ui.export(chosen if chosen is not None else opened, kind, renames, request)

        return made

    for button, kind in ((tab.md_btn, "md"), (tab.json_btn, "json")):
        button.click(
            export(kind),
            [bar.conversations, bar.current, bar.renames],
            tab.export_file,
            js=RENAMES_SO_FAR_JS,
            preprocess=False,
            show_progress="hidden",
        ).then(None, tab.export_file, None, js=DOWNLOAD_JS)

    drop = tab.drop_btn.click(ui.drop_oldest_and_answer, reply_inputs, reply_outputs, **quiet)
    drop.then(**refresh)

    def fresh(cid, system_prompt):
        conv = ui.store.create(system_prompt=system_prompt or "")
        return (
            gr.update(choices=ui.conversation_choices(), value=conv.id),
            gr.update(visible=False),
            gr.update(visible=False),
        )

    tab.fresh_btn.click(fresh, [bar.current, tab.system], [bar.conversations, tab.overflow, tab.overflow_row])
    return acted
