//! The console's HTML: escaping (every value from the database or a request goes through
//! [`esc`]), the page layout, and the headers every response carries (a Content-Security-Policy
//! that allows nothing but this origin's stylesheet and forms: no script, no external asset,
//! no framing). No JavaScript: pages refresh themselves with `<meta http-equiv="refresh">`.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};

/// The policy every response carries.
pub const CSP: &str = "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; \
                       frame-ancestors 'none'; base-uri 'none'";

/// `text` safe inside HTML text and attribute values.
pub fn esc(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c if c.is_control() && c != '\n' && c != '\t' => {
                out.extend(c.escape_default());
            }
            c => out.push(c),
        }
    }
    out
}

/// `value` for a URL query.
pub fn url(value: &str) -> String {
    form_urlencoded::byte_serialize(value.as_bytes()).collect()
}

/// Which section a page belongs to (the navigation marks it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Section {
    /// The overview.
    Overview,
    /// Messages not yet sent.
    Pending,
    /// Dead letters.
    DeadLetters,
    /// The audit trail.
    Audit,
}

/// A whole page: `body` (already HTML) in the layout, for `identity`; `refresh` reloads it.
pub fn page(
    title: &str,
    identity: &str,
    section: Section,
    refresh: Option<u32>,
    body: &str,
) -> Response {
    let nav = [
        (Section::Overview, "/", "Overview"),
        (Section::Pending, "/pending", "Pending"),
        (Section::DeadLetters, "/dead-letters", "Dead letters"),
        (Section::Audit, "/audit", "Audit trail"),
    ]
    .iter()
    .map(|(s, href, name)| {
        let current = if *s == section {
            " aria-current=\"page\""
        } else {
            ""
        };
        format!("<a href=\"{href}\"{current}>{name}</a>")
    })
    .collect::<Vec<_>>()
    .join(" ");
    let refresh = refresh.map_or(String::new(), |s| {
        format!("<meta http-equiv=\"refresh\" content=\"{s}\">")
    });
    let html = format!(
        "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">{refresh}\
         <title>{title} · pubsub-outbox</title><link rel=\"stylesheet\" href=\"/console.css\"></head>\
         <body><header><strong>pubsub-outbox</strong> <nav>{nav}</nav>\
         <span class=\"who\" id=\"identity\">{identity}</span></header>\
         <main><h1>{title}</h1>{body}</main></body></html>\n",
        title = esc(title),
        identity = esc(identity),
    );
    respond(StatusCode::OK, "text/html; charset=utf-8", html)
}

/// A page saying what went wrong, with `status`.
pub fn problem(status: StatusCode, identity: &str, message: &str) -> Response {
    let mut r = page(
        "Not done",
        identity,
        Section::Overview,
        None,
        &format!("<p class=\"error\" id=\"problem\">{}</p>", esc(message)),
    );
    *r.status_mut() = status;
    r
}

/// A response with the console's security headers.
pub fn respond(status: StatusCode, content_type: &'static str, body: String) -> Response {
    let mut r = (status, body).into_response();
    r.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    secure(r)
}

/// Adds the console's security headers to `r`: every response gets them, axum's own answers too
/// (a 404 for an unknown path, a 400 for a malformed one), as the last layer of the router.
pub async fn secure_every(r: Response) -> Response {
    secure(r)
}

fn secure(mut r: Response) -> Response {
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CSP),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(
        header::REFERRER_POLICY,
        // Not no-referrer: under it a browser sends `Origin: null` with a form's POST, which
        // the CSRF check must refuse; same-origin still tells no other site anything.
        HeaderValue::from_static("same-origin"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    r
}

/// A table: `head` cells and `rows` of cells already HTML; `id` names it for tests.
pub fn table(id: &str, head: &[&str], rows: &[Vec<String>]) -> String {
    if rows.is_empty() {
        return format!("<p class=\"empty\" id=\"{id}\">None.</p>");
    }
    let head: String = head.iter().map(|h| format!("<th>{h}</th>")).collect();
    let body: String = rows
        .iter()
        .map(|r| {
            let cells: String = r.iter().map(|c| format!("<td>{c}</td>")).collect();
            format!("<tr>{cells}</tr>")
        })
        .collect();
    format!("<table id=\"{id}\"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")
}

/// The stylesheet (served from this origin: the policy allows no other).
pub const CSS: &str = "\
body{font:14px/1.4 system-ui,sans-serif;margin:0;color:#1b1b1b;background:#fafafa}\
header{display:flex;gap:1.5em;align-items:center;padding:.6em 1.2em;background:#1f3a5f;color:#fff}\
header a{color:#dbe7ff;margin-right:1em;text-decoration:none}\
header a[aria-current]{color:#fff;text-decoration:underline}\
.who{margin-left:auto;font-size:90%}\
main{padding:0 1.2em 2em}\
table{border-collapse:collapse;margin:.5em 0 1.5em;background:#fff}\
th,td{border:1px solid #ddd;padding:.25em .6em;text-align:left;vertical-align:top}\
th{background:#eef2f7}\
.warn{background:#fff4d6;border-left:4px solid #e0a800;padding:.4em .8em;margin:.3em 0}\
.error{background:#fde2e1;border-left:4px solid #c62828;padding:.4em .8em}\
.ok{background:#e3f5e6;border-left:4px solid #2e7d32;padding:.4em .8em}\
form.inline{display:inline}\
fieldset{border:1px solid #ccc;margin:1em 0;padding:.6em 1em;background:#fff}\
input[type=text]{min-width:18em}\
pre{background:#fff;border:1px solid #ddd;padding:.6em;white-space:pre-wrap;word-break:break-all}\
.plots{display:flex;flex-wrap:wrap;gap:1em}\
figure{margin:0;background:#fff;border:1px solid #ddd;padding:.4em}\
figcaption{font-weight:600;margin-bottom:.2em}\
code{background:#eef2f7;padding:0 .2em}\
";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_from_the_database_cannot_become_markup() {
        assert_eq!(
            esc(r#"<script>alert("x")</script> & 'y'"#),
            "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt; &amp; &#39;y&#39;"
        );
        assert_eq!(
            esc("a\u{1b}[31mb"),
            "a\\u{1b}[31mb",
            "control characters escaped"
        );
        assert_eq!(url("a b&c=d/é"), "a+b%26c%3Dd%2F%C3%A9");
    }
}
