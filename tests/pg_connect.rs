//! How the binary connects to PostgreSQL as operators configure it: TLS
//! (a server that takes only encrypted connections, with a certificate of
//! its own certificate authority), URL forms and their refusals (said
//! without the password, naming what is wrong), and a role that may not
//! write. Each on a throw-away server of its own.

mod common;

use std::path::Path;
use std::process::{Command, Output};

const SESSION: &str = "11111111-2222-4333-8444-555555555555";

fn run(url: &str, args: &[&str], stdin: &str) -> Output {
    common::run_bin(url, args, stdin, &[])
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn log() -> String {
    [
        r#"{"type":"session_started","mode":"agent"}"#,
        r#"{"type":"catalog_defined","mode":"agent","deferred_tools":["web_fetch"]}"#,
        r#"{"type":"prompt_submitted","text":"one"}"#,
    ]
    .iter()
    .map(|l| format!(r#"{{"session_id":"{SESSION}",{}"#, &l[1..]))
    .collect::<Vec<_>>()
    .join("\n")
}

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .current_dir(dir)
        .args(args)
        .output()
        .expect("run openssl (the tests make their certificates with it)");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

/// A certificate authority and a server certificate it signed, for
/// `localhost` and 127.0.0.1, in `dir`.
fn certificates(dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "2",
            "-subj",
            "/CN=test-ca",
            "-keyout",
            "ca.key",
            "-out",
            "ca.crt",
        ],
    );
    openssl(
        dir,
        &[
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            "/CN=localhost",
            "-keyout",
            "server.key",
            "-out",
            "server.csr",
        ],
    );
    std::fs::write(
        dir.join("ext.cnf"),
        "subjectAltName=DNS:localhost,IP:127.0.0.1\n",
    )
    .unwrap();
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            "ext.cnf",
            "-out",
            "server.crt",
        ],
    );
    // PostgreSQL reads its key only if no one else may.
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(
        dir.join("server.key"),
        std::fs::Permissions::from_mode(0o600),
    )
    .unwrap();
    if is_root() {
        let ok = Command::new("chown")
            .args(["-R", "postgres:postgres"])
            .arg(dir)
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "chown of the certificates");
    }
}

/// A server that takes TCP connections only with TLS, and what each
/// `sslmode` does with it: `require` encrypts, `verify-full` checks the
/// certificate against the authority named by `sslrootcert` (and refuses
/// it without), `disable` is refused by the server.
#[test]
fn postgres_over_tls_encrypts_and_checks_the_certificate() {
    let Some(bin) = common::pg_bin() else {
        return;
    };
    let server = common::start_pg_server(&bin);
    let tls = server.dir.join("tls");
    certificates(&tls);
    let data = server.dir.join("data");
    let conf = format!(
        "\nssl = on\nssl_cert_file = '{0}/server.crt'\nssl_key_file = '{0}/server.key'\n",
        tls.display()
    );
    let mut pg_conf = std::fs::read_to_string(data.join("postgresql.conf")).unwrap();
    pg_conf.push_str(&conf);
    std::fs::write(data.join("postgresql.conf"), pg_conf).unwrap();
    std::fs::write(
        data.join("pg_hba.conf"),
        "local all all trust\nhostssl all all 127.0.0.1/32 trust\nhostnossl all all 127.0.0.1/32 reject\n",
    )
    .unwrap();
    server.stop();
    server.launch().unwrap_or_else(|e| panic!("{e}"));
    let base = format!("{}?", server.url());

    let out = run(&format!("{base}sslmode=require"), &["import"], &log());
    assert!(out.status.success(), "{}", stderr(&out));
    let ca = tls.join("ca.crt");
    for host in ["127.0.0.1", "localhost"] {
        let url = format!(
            "{}sslmode=verify-full&sslrootcert={}",
            base.replace("127.0.0.1", host),
            ca.display()
        );
        let out = run(&url, &["activations", SESSION, "--json"], "");
        assert!(out.status.success(), "{host}: {}", stderr(&out));
        assert!(
            String::from_utf8_lossy(&out.stdout).contains("\"tools\""),
            "{host}"
        );
    }
    // The certificate's authority is not one the binary trusts unless
    // named.
    let out = run(&format!("{base}sslmode=verify-full"), &["verify"], "");
    assert_eq!(out.status.code(), Some(4), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("TLS certificate was not accepted")
            && stderr(&out).contains("sslrootcert"),
        "{}",
        stderr(&out)
    );
    // Unencrypted: refused by the server, said in its words.
    let out = run(&format!("{base}sslmode=disable"), &["verify"], "");
    assert_eq!(out.status.code(), Some(4), "{}", stderr(&out));
    assert!(stderr(&out).contains("no encryption"), "{}", stderr(&out));
}

/// URLs the driver cannot use as written are refused (exit 2) naming
/// why, and never print the password; libpq's socket form with no host
/// connects; a role that may not write is said as such.
#[test]
fn postgres_urls_are_refused_precisely_and_a_read_only_role_is_said() {
    // Refusals made before any connection: no server needed.
    for (url, says) in [
        (
            "postgres://app:top/secret@127.0.0.1:1/db",
            "must be percent-encoded",
        ),
        (
            "postgres://app:p@ss:w/rd%#?& x@127.0.0.1:1/db",
            "must be percent-encoded",
        ),
        (
            "postgres://app:secret@127.0.0.1:1/db?channel_binding=require",
            "the parameter `channel_binding` is not one the PostgreSQL driver honours",
        ),
        (
            "postgres://127.0.0.1:1/db?user=app&password=secret&sslmode=bogus",
            "unknown value \"bogus\"",
        ),
        ("postgres://app@/db?port=1", "empty host"),
        (
            "postgres://127.0.0.1:1/db?sslpassword=secret",
            "the parameter `sslpassword`",
        ),
        (
            "postgres://127.0.0.1:1/db?port=x",
            "a parameter's value is not valid",
        ),
        (
            "mysql://app:secret@127.0.0.1:1/db",
            "unsupported database URL",
        ),
    ] {
        // A write too: it reads a URL that may name a new store first.
        let out = run(url, &["import"], "");
        assert_eq!(out.status.code(), Some(2), "{url}: {}", stderr(&out));
        assert!(!stderr(&out).contains("secret"), "{url}: {}", stderr(&out));
        let out = run(url, &["verify"], "");
        assert_eq!(out.status.code(), Some(2), "{url}: {}", stderr(&out));
        assert!(stderr(&out).contains(says), "{url}: {}", stderr(&out));
        for secret in ["secret", "ss:w"] {
            assert!(!stderr(&out).contains(secret), "{url}: {}", stderr(&out));
        }
    }
    // Refused before connecting, each naming what is wrong and never the
    // secret: a password's tail after an unencoded `&`, a libpq connection
    // string, TLS files that cannot serve, a `PGSSLMODE` the driver would
    // pass over.
    let scratch = tempfile::tempdir().unwrap();
    let not_pem = scratch.path().join("ca.pem");
    std::fs::write(&not_pem, "not a certificate\n").unwrap();
    // Files with the PEM blocks' markers: what is judged before connecting.
    let cert = scratch.path().join("client.crt");
    std::fs::write(
        &cert,
        "-----BEGIN CERTIFICATE-----\nAA==\n-----END CERTIFICATE-----\n",
    )
    .unwrap();
    let encrypted = scratch.path().join("client.key");
    std::fs::write(
        &encrypted,
        "-----BEGIN ENCRYPTED PRIVATE KEY-----\nAA==\n-----END ENCRYPTED PRIVATE KEY-----\n",
    )
    .unwrap();
    let (dir, cert, encrypted, not_pem) = (
        scratch.path().display().to_string(),
        cert.display().to_string(),
        encrypted.display().to_string(),
        not_pem.display().to_string(),
    );
    let no_env: &[(&str, &str)] = &[];
    for (url, env, says) in [
        (
            "postgres://127.0.0.1:1/db?password=ab&cd-secret-tail".to_owned(),
            no_env,
            "has no `=`".to_owned(),
        ),
        (
            "postgres://app:secret@127.0.0.1:1/db?sslmode=verify-full&sslrootcert=/nonexistent/ca.pem"
                .to_owned(),
            no_env,
            "`sslrootcert` names \"/nonexistent/ca.pem\", which cannot be read".to_owned(),
        ),
        (
            format!("postgres://127.0.0.1:1/db?sslmode=verify-ca&ssl-root-cert={not_pem}"),
            no_env,
            "holds no PEM certificate".to_owned(),
        ),
        (
            "postgres://127.0.0.1:1/db?sslmode=verify-full&sslrootcert=system".to_owned(),
            no_env,
            "libpq's `system`".to_owned(),
        ),
        (
            format!("postgres://127.0.0.1:1/db?sslmode=require&sslcert={dir}&sslkey={dir}"),
            no_env,
            "which is not a file".to_owned(),
        ),
        (
            format!("postgres://127.0.0.1:1/db?sslmode=require&sslcert={cert}"),
            no_env,
            "`sslcert` is given alone".to_owned(),
        ),
        (
            format!("postgres://127.0.0.1:1/db?sslmode=require&sslcert={cert}&sslkey={encrypted}"),
            no_env,
            "an encrypted private key".to_owned(),
        ),
        (
            "postgres://127.0.0.1:1/db".to_owned(),
            &[("PGSSLMODE", "bogus")],
            "PGSSLMODE (in the environment) is \"bogus\"".to_owned(),
        ),
        (
            "postgres://127.0.0.1:1/db".to_owned(),
            &[("PGSSLMODE", "verify-full"), ("PGSSLROOTCERT", "/nonexistent/ca.pem")],
            "PGSSLROOTCERT (in the environment) names".to_owned(),
        ),
    ] {
        let env: Vec<(&str, &std::ffi::OsStr)> = env
            .iter()
            .map(|(k, v)| (*k, std::ffi::OsStr::new(*v)))
            .collect();
        for args in [&["import"][..], &["verify"]] {
            let out = common::run_bin(&url, args, "", &env);
            assert_eq!(out.status.code(), Some(2), "{url}: {}", stderr(&out));
            assert!(stderr(&out).contains(&says), "{url}: {}", stderr(&out));
            assert!(!stderr(&out).contains("secret"), "{url}: {}", stderr(&out));
        }
    }
    // A libpq connection string, run where a file it made would be seen
    // (it names none: the relative path a SQLite store would have had).
    let conninfo = "host=127.0.0.1 port=1 dbname=db password=secret";
    for args in [&["import"][..], &["verify"]] {
        let out = Command::new(env!("CARGO_BIN_EXE_session-store"))
            .current_dir(scratch.path())
            .env_remove("DATABASE_URL")
            .arg("--database")
            .arg(conninfo)
            .args(args)
            .stdin(std::process::Stdio::null())
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
        assert!(
            stderr(&out).contains("libpq connection string") && !stderr(&out).contains("secret"),
            "{}",
            stderr(&out)
        );
        assert!(!scratch.path().join(conninfo).exists());
    }
    // Files the mode does not read are not judged (the driver would
    // connect: here to nothing, exit 4): an authority's under `require`,
    // libpq's `PGSSLROOTCERT=system` set for psql, a client's without TLS.
    for (url, env) in [
        (
            format!("postgres://127.0.0.1:1/db?sslmode=require&sslrootcert={not_pem}"),
            &[][..],
        ),
        (
            "postgres://127.0.0.1:1/db?sslmode=disable".to_owned(),
            &[
                ("PGSSLROOTCERT", "system"),
                ("PGSSLCERT", "/nonexistent/client.pem"),
            ][..],
        ),
    ] {
        let env: Vec<(&str, &std::ffi::OsStr)> = env
            .iter()
            .map(|(k, v)| (*k, std::ffi::OsStr::new(*v)))
            .collect();
        let out = common::run_bin(&url, &["verify"], "", &env);
        assert_eq!(out.status.code(), Some(4), "{url}: {}", stderr(&out));
    }
    // A `PGSSLMODE` the URL overrides is not judged; libpq variables the
    // driver does not read are said as a warning.
    let out = common::run_bin(
        "postgres://127.0.0.1:1/db?sslmode=disable",
        &["verify"],
        "",
        &[
            ("PGSSLMODE", std::ffi::OsStr::new("bogus")),
            ("PGTARGETSESSIONATTRS", std::ffi::OsStr::new("read-write")),
        ],
    );
    assert_eq!(out.status.code(), Some(4), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("PGTARGETSESSIONATTRS") && stderr(&out).contains("no effect"),
        "{}",
        stderr(&out)
    );
    // `--help` names the environment variable, not its value.
    let out = common::run_bin(
        "x.db",
        &["--help"],
        "",
        &[(
            "DATABASE_URL",
            std::ffi::OsStr::new("postgres://app:secret@127.0.0.1:1/db"),
        )],
    );
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(
        help.contains("DATABASE_URL") && !help.contains("secret"),
        "{help}"
    );

    let Some(bin) = common::pg_bin() else {
        return;
    };
    let server = common::start_pg_server(&bin);
    let url = server.url();
    let out = run(&url, &["import"], &log());
    assert!(out.status.success(), "{}", stderr(&out));
    // libpq's form for a socket: no host, its directory as `host`.
    let port = url.rsplit_once(':').unwrap().1.split('/').next().unwrap();
    let socket = format!(
        "postgres://postgres@/postgres?host={}&port={port}",
        server.dir.display()
    );
    let out = run(&socket, &["activations", SESSION], "");
    assert!(out.status.success(), "{socket}: {}", stderr(&out));
    let socket = format!(
        "postgres://postgres@:{port}/postgres?host={}",
        server.dir.display()
    );
    let out = run(&socket, &["activations", SESSION], "");
    assert!(out.status.success(), "{socket}: {}", stderr(&out));
    // A search_path naming a schema that does not exist: said with how to
    // make it (not as an outage to retry), the store left unmade.
    let no_schema = format!("{url}?options=-csearch_path%3Dnosuch");
    for args in [&["migrate"][..], &["import"]] {
        let out = run(&no_schema, args, &log());
        assert_eq!(out.status.code(), Some(4), "{args:?}: {}", stderr(&out));
        let err = stderr(&out);
        assert!(
            err.contains("does not exist in this database") && err.contains("CREATE SCHEMA"),
            "{args:?}: {err}"
        );
    }
    common::raw_sql(&url, "CREATE SCHEMA nosuch");
    let out = run(&no_schema, &["migrate"], "");
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        String::from_utf8_lossy(&out.stdout).starts_with("created the schema: migration "),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    // A role whose transactions are read-only, and one that may only read.
    for sql in [
        "CREATE ROLE ro LOGIN",
        "ALTER ROLE ro SET default_transaction_read_only = on",
        "GRANT ALL ON ALL TABLES IN SCHEMA public TO ro",
        "GRANT ALL ON ALL SEQUENCES IN SCHEMA public TO ro",
        "CREATE ROLE sel LOGIN",
        "GRANT SELECT ON ALL TABLES IN SCHEMA public TO sel",
    ] {
        common::raw_sql(&url, sql);
    }
    let prompt = r#"{"type":"prompt_submitted","text":"two"}"#;
    for (role, says) in [
        ("ro", "read-only transaction"),
        ("sel", "permission denied"),
    ] {
        let as_role = url.replace("postgres@", &format!("{role}@"));
        let out = run(
            &as_role,
            &["append", SESSION, "--expected-seq", "3"],
            prompt,
        );
        assert_eq!(out.status.code(), Some(4), "{role}: {}", stderr(&out));
        let err = stderr(&out);
        assert!(
            err.contains("the database refused this role") && err.contains(says),
            "{role}: {err}"
        );
        // `import` says it at once: trying again cannot help (it tried for
        // 10 s).
        let started = std::time::Instant::now();
        let line = format!(r#"{{"session_id":"{SESSION}",{}"#, &prompt[1..]);
        let out = run(&as_role, &["import"], &line);
        assert_eq!(out.status.code(), Some(4), "{role}: {}", stderr(&out));
        assert!(
            stderr(&out).contains("the database refused this role"),
            "{role}: {}",
            stderr(&out)
        );
        // One line, said as one, and the cause's kind said once.
        assert!(
            stderr(&out).contains(&format!("line 1 (session {SESSION}) was not stored"))
                && stderr(&out).matches("database error").count() == 1,
            "{role}: {}",
            stderr(&out)
        );
        assert!(
            started.elapsed() < std::time::Duration::from_secs(5),
            "{role}: import took {:?}",
            started.elapsed()
        );
        // Reading is what it may do.
        let out = run(&as_role, &["activations", SESSION], "");
        assert!(out.status.success(), "{role}: {}", stderr(&out));
    }
    let out = run(&url, &["history", SESSION, "--json"], "");
    assert_eq!(String::from_utf8_lossy(&out.stdout).lines().count(), 3);
}
