"""Deferred tools: hidden from the model until a tool_search finds them (load on both sides)."""

from __future__ import annotations

from pydantic import BaseModel

from toolq import ToolContext, tool

#: Fixed for the test: 1 EUR = 1.25 USD.
RATE = 1.25


class ConvertArgs(BaseModel):
    amount: float
    currency: str


@tool(deferred=True)
def convert_currency(args: ConvertArgs, ctx: ToolContext) -> str:
    """Converts an amount of euros into another currency at today's exchange rate."""
    if args.currency != "USD":
        return f"no rate for {args.currency}"
    return f"{args.amount:g} EUR = {args.amount * RATE:g} USD"


class EventArgs(BaseModel):
    title: str


@tool(namespace="calendar", deferred=True)
def create_event(args: EventArgs, ctx: ToolContext) -> str:
    """Adds an event to the user's calendar."""
    return f"created {args.title}"
