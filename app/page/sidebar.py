"""The sidebar: New chat, the search box, the chat list, rename or delete the open chat, and every chat exported to
one file or imported from one (Pagoda's, Open WebUI's, ChatGPT's)."""

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

import gradio as gr

from app.store_records import NEW_CHAT_TITLE

if TYPE_CHECKING:
    from app.ui import PagodaUI

# The page numbers its Rename clicks (window.pagodaRenames) and sends the count with each Rename and Export: an
# Export waits for the Renames clicked before it (PagodaUI.export), whichever request reaches the server first.
COUNT_RENAME_JS = (
    "(chosen, opened, title) => [chosen, opened, title, (window.pagodaRenames = (window.pagodaRenames || 0) + 1)]"
)
RENAMES_SO_FAR_JS = "(chosen, opened) => [chosen, opened, window.pagodaRenames || 0]"


@dataclass
class Sidebar:
    new_btn: gr.Button
    search: gr.Textbox
    conversations: gr.Radio
    current: gr.Number  # the open chat's id, which every chat event reads
    title: gr.Textbox
    rename_btn: gr.Button
    delete_btn: gr.Button
    pin_btn: gr.Button
    folder: gr.Textbox
    folder_btn: gr.Button
    renames: gr.Number  # carries the page's count of Rename clicks (set by COUNT_RENAME_JS, RENAMES_SO_FAR_JS)
    export_all_btn: gr.Button
    import_btn: gr.UploadButton
    archive_file: gr.File  # the archive Export all just made, which the browser then downloads


def render_sidebar(ui: "PagodaUI") -> Sidebar:
    new_btn = gr.Button("＋ New chat", variant="primary", elem_id="new-chat")
    search = gr.Textbox(placeholder="Search chats…", show_label=False, container=False)
    conversations = gr.Radio(choices=ui.conversation_choices(), label="Chats", elem_id="chat-list")
    # Events read this rather than the Radio, whose value must be one of the choices it was built with
    # (API clients never see the updated choices).
    current = gr.Number(visible=False, precision=0)
    with gr.Accordion("Rename, pin, folder or delete", open=False):
        title = gr.Textbox(label="Title")
        with gr.Row():
            rename_btn = gr.Button("Rename", size="sm")
            delete_btn = gr.Button("Delete", size="sm", variant="stop")
        pin_btn = gr.Button("Pin to top", size="sm", elem_id="pin-chat")
        with gr.Row():
            folder = gr.Textbox(label="Folder", placeholder="none", scale=3, elem_id="chat-folder")
            folder_btn = gr.Button("Move", size="sm", scale=1)
    renames = gr.Number(visible=False, precision=0)
    with gr.Accordion("Import or export all", open=False):
        export_all_btn = gr.Button("Export all chats", size="sm", elem_id="export-all")
        import_btn = gr.UploadButton(
            "Import chats", size="sm", file_types=[".json"], elem_id="import-chats", file_count="single"
        )
        gr.Markdown(
            "<sub>One file with every chat, its branches and files, and the presets. Import takes it back (what "
            "is here already is skipped), or an Open WebUI export, or ChatGPT's conversations.json.</sub>"
        )
    archive_file = gr.File(visible="hidden", elem_id="archive-file")
    return Sidebar(
        new_btn,
        search,
        conversations,
        current,
        title,
        rename_btn,
        delete_btn,
        pin_btn,
        folder,
        folder_btn,
        renames,
        export_all_btn,
        import_btn,
        archive_file,
    )


def wire_sidebar(ui: "PagodaUI", bar: Sidebar, system: gr.Textbox) -> None:
    """The sidebar's events; a new chat starts with the Chat tab's system prompt (`system`)."""
    # No preprocessing: the Radio would check the id against this page's choices as the server last stored them,
    # and a refresh computed just before New chat (a reply's title) can store a list without the new chat, failing
    # the change ("Value: 15 is not in the list of choices", seen on CI), so the new chat never opened.
    bar.conversations.change(lambda cid: cid, bar.conversations, bar.current, preprocess=False)
    # What the user types as a title stays theirs until they pick a chat (`input`: the user's picks only, not New
    # chat's or a reply's updates of the list) or rename (PagodaUI.title_typed)
    bar.conversations.input(
        ui.asked_for_chat, bar.conversations, None, preprocess=False, show_progress="hidden", api_visibility="private"
    )
    bar.title.input(ui.title_typed, None, None, show_progress="hidden", api_visibility="private")
    bar.search.change(lambda q: gr.update(choices=ui.conversation_choices(q)), bar.search, bar.conversations)
    # Pinned chats come first; a folder's name goes before its chats' titles, and search finds it
    bar.current.change(ui.chat_place, bar.current, [bar.pin_btn, bar.folder], show_progress="hidden")
    bar.pin_btn.click(ui.toggle_pin, bar.current, [bar.conversations, bar.pin_btn])
    bar.folder_btn.click(ui.move_to_folder, [bar.current, bar.folder], bar.conversations)
    bar.folder.submit(ui.move_to_folder, [bar.current, bar.folder], bar.conversations)
    bar.new_btn.click(ui.new_chat, [system, bar.search], bar.conversations, api_name="new_chat")
    # The Title field shows the new chat's title at the click, in the browser: the user may type in it at once, and
    # the chat's opening, which comes later, leaves it alone (PagodaUI.open)
    bar.new_btn.click(None, None, bar.title, js=f"() => {json.dumps(NEW_CHAT_TITLE)}", show_progress="hidden")

    # The chat chosen in the list, read as the page has it (as its change does): `current` follows it an event later
    def rename(chosen, opened, title, number, request: gr.Request):
        return ui.rename(chosen if chosen is not None else opened, title, number, request)

    bar.rename_btn.click(
        rename,
        [bar.conversations, bar.current, bar.title, bar.renames],
        bar.conversations,
        js=COUNT_RENAME_JS,
        preprocess=False,
    )

    # Deleting cannot be undone, so the browser asks first; a "no" sends no chat id.
    bar.delete_btn.click(
        ui.delete_chat,
        bar.current,
        bar.conversations,
        api_name="delete",
        js="(cid) => (cid !== null && confirm('Delete this chat and all its messages? "
        "This cannot be undone.')) ? cid : null",
    )


def wire_archive(ui: "PagodaUI", bar: Sidebar, download_js: str) -> None:
    """Export all (the browser saves the file, `download_js`) and Import chats (the list shows what came in)."""
    bar.export_all_btn.click(ui.export_all, None, bar.archive_file, show_progress="hidden").then(
        None, bar.archive_file, None, js=download_js
    )
    bar.import_btn.upload(ui.import_chats, bar.import_btn, bar.conversations, api_visibility="private")


def load_first_view(demo: gr.Blocks, ui: "PagodaUI", bar: Sidebar, presets: dict[str, str], js: str) -> None:
    """A page opens on the first chat of the list, made (with the first preset's prompt) when there is
    none; `js` runs in the page as it loads."""

    def first_view():
        choices = ui.conversation_choices()
        if not choices:
            ui.store.create(system_prompt=next(iter(presets.values()), ""))
            choices = ui.conversation_choices()
        return gr.update(choices=choices, value=choices[0][1])

    demo.load(first_view, None, bar.conversations, js=js)
