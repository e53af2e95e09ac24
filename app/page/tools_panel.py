"""The Chat tab's Tools panel: the MCP servers of mcp.json and their tools, which of them the open chat may call
(none until the user picks them), when it calls them, and how many rounds of calls one reply may make."""

from dataclasses import dataclass
from typing import TYPE_CHECKING

import gradio as gr

from app.chat_settings import ChatSettings

if TYPE_CHECKING:
    from app.page.sidebar import Sidebar
    from app.ui import PagodaUI


@dataclass
class ToolsPanel:
    panel: gr.Accordion
    status: gr.Markdown
    tools: gr.CheckboxGroup
    tool_choice: gr.Radio
    tool_rounds: gr.Slider
    always: gr.CheckboxGroup
    reload_btn: gr.Button


def render_tools_panel() -> ToolsPanel:
    default = ChatSettings()
    with gr.Accordion("Tools (MCP servers)", open=False, elem_id="tools-panel") as panel:
        status = gr.Markdown("Open this panel to start the servers and list their tools.", elem_id="tools-status")
        tools = gr.CheckboxGroup([], label="Tools this chat may call (each call asks you first)", elem_id="chat-tools")
        with gr.Row():
            tool_choice = gr.Radio(
                [("When the model chooses", "auto"), ("Before each answer", "first")],
                value=default.tool_choice,
                label="Calls",
                elem_id="tool-choice",
            )
            tool_rounds = gr.Slider(
                1, 20, value=default.tool_rounds, step=1, label="Rounds of calls per reply", elem_id="tool-rounds"
            )
        # Shown once the user chose "Always for this tool" in the chat: untick to be asked again
        always = gr.CheckboxGroup([], label="Run without asking (untick to be asked again)", visible=False)
        reload_btn = gr.Button("Reload mcp.json", size="sm", elem_id="reload-tools")
    return ToolsPanel(panel, status, tools, tool_choice, tool_rounds, always, reload_btn)


def wire_tools_panel(ui: "PagodaUI", panel: ToolsPanel, bar: "Sidebar", message_action) -> None:
    """Opening the panel starts the servers and lists their tools; opening a chat shows its choices, and so does a
    call's answer (Always adds its tool to those run without asking); what the user sets is kept with the chat."""
    values = [panel.tools, panel.tool_choice, panel.tool_rounds, panel.always]
    panel.panel.expand(ui.list_tools, bar.current, [panel.status, *values], show_progress="minimal")
    panel.reload_btn.click(ui.reload_tools, bar.current, [panel.status, *values])
    bar.current.change(ui.chat_tool_values, bar.current, values, show_progress="hidden")
    message_action.then(ui.chat_tool_values, bar.current, values, show_progress="hidden")
    for part in values:
        part.input(ui.set_chat_tools, [bar.current, *values], None, show_progress="hidden")
