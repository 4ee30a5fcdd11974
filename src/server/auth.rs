//! Bearer tokens: who is calling, for which tenant, with which scopes.
//!
//! Tokens come from a JSON document (a file, or the environment) so they
//! never appear on a command line or in `ps`. The server keeps only their
//! SHA-256 digests and compares a presented token's digest with every
//! configured one in constant time (`subtle`), without stopping at the
//! first match, so neither a token's content nor its length leaks through
//! timing. Tokens are never logged: the tracing spans name the tenant only.

use std::collections::HashSet;

use axum::http::{header, HeaderMap, StatusCode};
use serde::Deserialize;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use super::error::ApiError;

/// The shortest token accepted: shorter ones are guessable.
pub const MIN_TOKEN_LEN: usize = 16;

/// What a token allows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Scope {
    /// Read a session: history, context, activations, recovery, stream,
    /// explain.
    Read,
    /// Append events.
    Write,
    /// Cross-session audit queries of the tenant's sessions.
    Audit,
}

impl Scope {
    fn name(self) -> &'static str {
        match self {
            Scope::Read => "read",
            Scope::Write => "write",
            Scope::Audit => "audit",
        }
    }
}

/// The caller of a request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Principal {
    /// The tenant whose sessions the caller sees.
    pub tenant: String,
    scopes: HashSet<Scope>,
}

impl Principal {
    /// The caller of a server without tokens: the default tenant, every
    /// scope.
    pub fn open() -> Principal {
        Principal {
            tenant: crate::store::DEFAULT_TENANT.to_owned(),
            scopes: [Scope::Read, Scope::Write, Scope::Audit].into(),
        }
    }

    /// 403 unless the caller has `scope`.
    pub fn require(&self, scope: Scope) -> Result<(), ApiError> {
        if self.scopes.contains(&scope) {
            Ok(())
        } else {
            Err(ApiError::new(
                StatusCode::FORBIDDEN,
                "forbidden",
                format!("this token lacks the `{}` scope", scope.name()),
            ))
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TokenEntry {
    token: String,
    tenant: String,
    scopes: Vec<Scope>,
}

struct Configured {
    digest: [u8; 32],
    principal: Principal,
}

/// The configured tokens.
pub struct Tokens {
    entries: Vec<Configured>,
}

impl std::fmt::Debug for Tokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the tokens, not even their digests.
        write!(f, "Tokens({} configured)", self.entries.len())
    }
}

fn digest(token: &[u8]) -> [u8; 32] {
    Sha256::digest(token).into()
}

/// What is wrong with the `i`-th entry of a token document, said without
/// its content: a scope name is quoted only when it is too short to be a
/// token.
fn misshapen(source: &str, i: usize, entry: &serde_json::Value) -> String {
    let at = format!("{source}, token {}", i + 1);
    let unknown_scope = entry
        .get("scopes")
        .and_then(serde_json::Value::as_array)
        .and_then(|scopes| {
            scopes.iter().find_map(|s| {
                s.as_str()
                    .filter(|n| !["read", "write", "audit"].contains(n))
            })
        });
    match unknown_scope {
        Some(name) if name.len() < MIN_TOKEN_LEN => {
            format!("{at}: {name:?} is not a scope (read, write, audit)")
        }
        Some(_) => format!("{at}: a scope is not one of read, write, audit"),
        None => format!(
            "{at} is not an object with exactly the fields \"token\" and \"tenant\" (strings) and \"scopes\" (a list of read, write, audit)"
        ),
    }
}

impl Tokens {
    /// Parses a token document:
    /// `{"tokens": [{"token": "…", "tenant": "…", "scopes": ["read"]}]}`.
    /// `source` names where it came from, for the error sentence.
    pub fn parse(text: &str, source: &str) -> Result<Tokens, String> {
        // serde's messages quote what they refuse (a value of the wrong
        // type, an unknown field's name), and in a token document that may
        // be a token: given where an object belongs, or as a key. So the
        // text is read as JSON first, whose syntax errors quote nothing,
        // and what has the wrong shape is said by its place alone.
        const SHAPE: &str =
            r#"{"tokens": [{"token": "…", "tenant": "…", "scopes": ["read", "write", "audit"]}]}"#;
        let value: serde_json::Value = serde_json::from_str(text)
            .map_err(|e| format!("{source} is not a token document ({SHAPE}): {e}"))?;
        // A parser keeps one of a key's two values: an operator reading
        // `"tenant": "a", "tenant": "b"` cannot tell which tenant (or which
        // scopes) the token has. Said by place only (a key may be a token).
        if let Err(e) = crate::event::check_unique_keys(text.as_bytes()) {
            return Err(format!(
                "{source} gives one key twice in an object (line {}, column {}): which of the two values holds is not clear, so the document is refused",
                e.line(),
                e.column()
            ));
        }
        let tokens = value
            .as_object()
            .filter(|o| o.len() == 1)
            .and_then(|o| o.get("tokens"))
            .and_then(serde_json::Value::as_array)
            .ok_or_else(|| {
                format!(
                    "{source} is not a token document ({SHAPE}): it must be an object whose one field, \"tokens\", is a list"
                )
            })?;
        let tokens: Vec<TokenEntry> = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| TokenEntry::deserialize(t).map_err(|_| misshapen(source, i, t)))
            .collect::<Result<_, _>>()?;
        if tokens.is_empty() {
            return Err(format!("{source} lists no tokens"));
        }
        let mut seen = HashSet::new();
        let mut entries = Vec::with_capacity(tokens.len());
        for (i, t) in tokens.into_iter().enumerate() {
            let at = format!("{source}, token {} (tenant {:?})", i + 1, t.tenant);
            if t.token.len() < MIN_TOKEN_LEN {
                return Err(format!(
                    "{at}: a token must be at least {MIN_TOKEN_LEN} characters long"
                ));
            }
            // What an HTTP header carries as `Bearer TOKEN`: visible ASCII.
            // A token with other characters was accepted here and could
            // never authenticate.
            if !t.token.bytes().all(|b| b.is_ascii_graphic()) {
                return Err(format!(
                    "{at}: a token must be visible ASCII characters only (no spaces, control characters or non-ASCII letters), as an Authorization header carries it"
                ));
            }
            if let Some(problem) = crate::validate::tenant_name_problem(&t.tenant) {
                return Err(format!(
                    "{at}: the tenant {} cannot be used: {problem}",
                    crate::error::quoted(&t.tenant)
                ));
            }
            if t.scopes.is_empty() {
                return Err(format!("{at}: the token has no scopes"));
            }
            let d = digest(t.token.as_bytes());
            if !seen.insert(d) {
                return Err(format!("{at}: the same token is listed twice"));
            }
            entries.push(Configured {
                digest: d,
                principal: Principal {
                    tenant: t.tenant,
                    scopes: t.scopes.into_iter().collect(),
                },
            });
        }
        Ok(Tokens { entries })
    }

    /// How many tokens are configured.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether no token is configured.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The caller named by the request's `Authorization: Bearer` header;
    /// 401 without one or with an unknown token.
    pub fn authenticate(&self, headers: &HeaderMap) -> Result<Principal, ApiError> {
        let unauthorized = |m: &str| ApiError::new(StatusCode::UNAUTHORIZED, "unauthorized", m);
        let Some(value) = headers.get(header::AUTHORIZATION) else {
            return Err(unauthorized(
                "this server requires a bearer token: send `Authorization: Bearer TOKEN`",
            ));
        };
        if headers
            .get_all(header::AUTHORIZATION)
            .iter()
            .nth(1)
            .is_some()
        {
            // Two credentials: which one is meant is not for the server to
            // guess.
            return Err(unauthorized(
                "more than one Authorization header was sent: send one `Authorization: Bearer TOKEN`",
            ));
        }
        let presented = value
            .to_str()
            .ok()
            .and_then(|v| {
                let (scheme, rest) = v.split_once(' ')?;
                scheme.eq_ignore_ascii_case("bearer").then(|| rest.trim())
            })
            .ok_or_else(|| unauthorized("the Authorization header must be `Bearer TOKEN`"))?;
        let d = digest(presented.as_bytes());
        let mut found: Option<&Principal> = None;
        for c in &self.entries {
            // Every entry is compared; a match is remembered, not returned.
            if bool::from(c.digest.ct_eq(&d)) {
                found = Some(&c.principal);
            }
        }
        found
            .cloned()
            .ok_or_else(|| unauthorized("the bearer token is not valid"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    const DOC: &str = r#"{"tokens": [
        {"token": "acme-read-write-0123456789", "tenant": "acme", "scopes": ["read", "write"]},
        {"token": "globex-audit-0123456789", "tenant": "globex", "scopes": ["audit"]}
    ]}"#;

    fn headers(v: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(header::AUTHORIZATION, HeaderValue::from_str(v).unwrap());
        h
    }

    /// A token document's tenant follows the one rule of names: one
    /// with a space at an end, or a direction override, is refused at
    /// start, named.
    #[test]
    fn token_documents_refuse_tenants_no_one_could_tell_apart() {
        for tenant in ["acme ", " acme", "\u{202E}acme", ""] {
            let doc = serde_json::json!({"tokens": [
                {"token": "0123456789abcdef0123", "tenant": tenant, "scopes": ["read"]}
            ]})
            .to_string();
            let err = Tokens::parse(&doc, "test").err().unwrap_or_default();
            assert!(err.contains("cannot be used"), "{tenant:?}: {err}");
        }
    }

    #[test]
    fn known_tokens_name_their_tenant_and_scopes() {
        let t = Tokens::parse(DOC, "test").unwrap();
        let p = t
            .authenticate(&headers("Bearer acme-read-write-0123456789"))
            .unwrap();
        assert_eq!(p.tenant, "acme");
        assert!(p.require(Scope::Write).is_ok());
        assert_eq!(
            p.require(Scope::Audit).unwrap_err().status,
            StatusCode::FORBIDDEN
        );
        let g = t
            .authenticate(&headers("bearer globex-audit-0123456789"))
            .unwrap();
        assert_eq!(g.tenant, "globex");
    }

    #[test]
    fn unknown_missing_or_malformed_tokens_are_401() {
        let t = Tokens::parse(DOC, "test").unwrap();
        for h in [
            headers("Bearer acme-read-write-012345678"),
            headers("Basic acme-read-write-0123456789"),
            headers("acme-read-write-0123456789"),
            HeaderMap::new(),
        ] {
            assert_eq!(
                t.authenticate(&h).unwrap_err().status,
                StatusCode::UNAUTHORIZED
            );
        }
    }

    #[test]
    fn bad_documents_are_refused_with_the_reason() {
        for (doc, needle) in [
            (r#"{"tokens": []}"#, "no tokens"),
            (
                r#"{"tokens": [{"token": "short", "tenant": "a", "scopes": ["read"]}]}"#,
                "at least 16",
            ),
            (
                r#"{"tokens": [{"token": "0123456789abcdef", "tenant": "", "scopes": ["read"]}]}"#,
                "tenant",
            ),
            (
                r#"{"tokens": [{"token": "0123456789abcdef", "tenant": "a", "scopes": []}]}"#,
                "no scopes",
            ),
            (
                r#"{"tokens": [{"token": "0123456789abcdef", "tenant": "a", "scopes": ["admin"]}]}"#,
                "admin",
            ),
            (
                r#"{"tokens": [{"token": "0123456789abcdef", "tenant": "a", "scopes": ["read"]},
                            {"token": "0123456789abcdef", "tenant": "b", "scopes": ["read"]}]}"#,
                "twice",
            ),
            (
                r#"{"tokens": [{"token": "éééééééééééééééé", "tenant": "a", "scopes": ["read"]}]}"#,
                "visible ASCII",
            ),
            (
                r#"{"tokens": [{"token": "0123456789 abcdef", "tenant": "a", "scopes": ["read"]}]}"#,
                "visible ASCII",
            ),
            ("not json", "not a token document"),
            (r#"["a"]"#, "one field"),
            (r#"{"tokens": ["x"], "more": 1}"#, "one field"),
            (
                r#"{"tokens": [{"token": "t", "tenant": "a"}]}"#,
                "token 1 is not an object",
            ),
            (
                r#"{"tokens": [{"token": "0123456789abcdef", "tenant": "a", "scopes": ["read"], "x": 1}]}"#,
                "token 1 is not an object",
            ),
            // Which tenant, which scopes? Neither value is chosen.
            (
                r#"{"tokens": [{"token": "0123456789abcdef", "tenant": "a", "tenant": "b", "scopes": ["read"]}]}"#,
                "gives one key twice in an object (line 1, column 65)",
            ),
            (
                r#"{"tokens": [{"token": "0123456789abcdef", "tenant": "a", "scopes": ["read"], "scopes": ["read", "write"]}]}"#,
                "gives one key twice",
            ),
        ] {
            let err = Tokens::parse(doc, "tokens.json").unwrap_err();
            assert!(err.contains(needle), "{err}");
            assert!(err.starts_with("tokens.json"), "{err}");
        }
    }

    /// A token given where the document's shape wants something else (an
    /// entry, a key, a scope) is never quoted back: the error goes to the
    /// terminal and the logs.
    #[test]
    fn errors_never_quote_a_token() {
        let secret = "my-secret-token-0123456789";
        for doc in [
            format!(r#"{{"tokens": ["{secret}"]}}"#),
            format!(r#"{{"tokens": [{{"{secret}": 1, "tenant": "a", "scopes": ["read"]}}]}}"#),
            format!(
                r#"{{"tokens": [{{"token": "{secret}", "tenant": "a", "scopes": ["{secret}"]}}]}}"#
            ),
            format!(
                r#"{{"tokens": [{{"token": ["{secret}"], "tenant": "a", "scopes": ["read"]}}]}}"#
            ),
            format!(r#"{{"{secret}": []}}"#),
            format!(r#"{{"tokens": [{{"token": "{secret}", "tenant": "a", "scopes": ["read"]}}]"#),
            format!(
                r#"{{"tokens": [{{"{secret}": 1, "{secret}": 2, "tenant": "a", "scopes": ["read"]}}]}}"#
            ),
        ] {
            let err = Tokens::parse(&doc, "tokens.json").unwrap_err();
            assert!(!err.contains(secret), "{err}");
            assert!(err.starts_with("tokens.json"), "{err}");
        }
    }

    #[test]
    fn debug_output_never_shows_tokens() {
        let t = Tokens::parse(DOC, "test").unwrap();
        let shown = format!("{t:?}");
        assert!(!shown.contains("acme-read"), "{shown}");
    }
}
