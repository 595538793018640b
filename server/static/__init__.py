"""The /cache/view page (html, js, css), served from the installed package by routes_cache."""
