//! SCRAM (RFC 5802; SHA-256 in RFC 7677) on the server side, as Couchbase speaks it over
//! SASL_AUTH and SASL_STEP: SCRAM-SHA1, SCRAM-SHA256 and SCRAM-SHA512, no channel binding.
//!
//! The server keeps per user and mechanism the salt, the iteration count, StoredKey and
//! ServerKey (`Keys`): enough to check a client's proof and to sign the exchange, not enough to
//! log in (neither the password nor the salted password is kept).
//!
//! An exchange for a user without keys (unknown, or lacking this mechanism) runs like any
//! other: a salt derived from the name with a per-process secret (the same salt every time for
//! the same name, so a second look tells nothing), the iteration count configured, the same
//! work at the end and the same failure.

use std::sync::LazyLock;

use ring::{digest, hmac, pbkdf2};

use sluice_proto::base64;

/// A SCRAM mechanism by its hash.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Mechanism {
    Sha512,
    Sha256,
    Sha1,
}

impl Mechanism {
    /// Strongest first, the order SASL_LIST_MECHS names them in.
    pub const ALL: [Mechanism; 3] = [Mechanism::Sha512, Mechanism::Sha256, Mechanism::Sha1];

    /// The SASL name, as Couchbase spells it (no dash before the digits).
    pub fn sasl_name(self) -> &'static str {
        match self {
            Mechanism::Sha512 => "SCRAM-SHA512",
            Mechanism::Sha256 => "SCRAM-SHA256",
            Mechanism::Sha1 => "SCRAM-SHA1",
        }
    }

    /// The scheme of a stored credential string (`scram-sha512:...`).
    pub fn scheme(self) -> &'static str {
        match self {
            Mechanism::Sha512 => "scram-sha512",
            Mechanism::Sha256 => "scram-sha256",
            Mechanism::Sha1 => "scram-sha1",
        }
    }

    pub fn from_sasl_name(name: &[u8]) -> Option<Mechanism> {
        Mechanism::ALL
            .into_iter()
            .find(|m| m.sasl_name().as_bytes() == name)
    }

    pub fn from_scheme(scheme: &str) -> Option<Mechanism> {
        Mechanism::ALL.into_iter().find(|m| m.scheme() == scheme)
    }

    /// The hash's output length: StoredKey, ServerKey, a proof and a signature all have it.
    pub fn key_len(self) -> usize {
        match self {
            Mechanism::Sha512 => 64,
            Mechanism::Sha256 => 32,
            Mechanism::Sha1 => 20,
        }
    }

    fn hmac(self, key: &[u8], data: &[u8]) -> Vec<u8> {
        let algorithm = match self {
            Mechanism::Sha512 => hmac::HMAC_SHA512,
            Mechanism::Sha256 => hmac::HMAC_SHA256,
            Mechanism::Sha1 => hmac::HMAC_SHA1_FOR_LEGACY_USE_ONLY,
        };
        hmac::sign(&hmac::Key::new(algorithm, key), data)
            .as_ref()
            .to_vec()
    }

    fn hash(self, data: &[u8]) -> Vec<u8> {
        let algorithm = match self {
            Mechanism::Sha512 => &digest::SHA512,
            Mechanism::Sha256 => &digest::SHA256,
            Mechanism::Sha1 => &digest::SHA1_FOR_LEGACY_USE_ONLY,
        };
        digest::digest(algorithm, data).as_ref().to_vec()
    }

    /// SaltedPassword := Hi(password, salt, i), PBKDF2 with this hash's HMAC.
    fn salted_password(self, password: &[u8], salt: &[u8], iterations: u32) -> Vec<u8> {
        let algorithm = match self {
            Mechanism::Sha512 => pbkdf2::PBKDF2_HMAC_SHA512,
            Mechanism::Sha256 => pbkdf2::PBKDF2_HMAC_SHA256,
            Mechanism::Sha1 => pbkdf2::PBKDF2_HMAC_SHA1,
        };
        let mut out = vec![0; self.key_len()];
        let iterations = std::num::NonZeroU32::new(iterations.max(1)).expect("at least 1");
        pbkdf2::derive(algorithm, iterations, salt, password, &mut out);
        out
    }
}

/// What the server keeps for one user and mechanism.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Keys {
    pub mechanism: Mechanism,
    pub iterations: u32,
    pub salt: Vec<u8>,
    pub stored_key: Vec<u8>,
    pub server_key: Vec<u8>,
}

impl Keys {
    /// The keys of a password (what `sluice user hash` computes, and PLAIN's check).
    pub fn derive(mechanism: Mechanism, password: &[u8], salt: &[u8], iterations: u32) -> Keys {
        let salted = mechanism.salted_password(password, salt, iterations);
        let client_key = mechanism.hmac(&salted, b"Client Key");
        Keys {
            mechanism,
            iterations,
            salt: salt.to_vec(),
            stored_key: mechanism.hash(&client_key),
            server_key: mechanism.hmac(&salted, b"Server Key"),
        }
    }

    /// SASL PLAIN's check against these keys: the client's side of SCRAM done here, as slow as
    /// the iteration count makes it.
    pub fn verify_password(&self, password: &[u8]) -> bool {
        let derived = Keys::derive(self.mechanism, password, &self.salt, self.iterations);
        constant_time_eq(&derived.stored_key, &self.stored_key)
    }
}

/// Whether two byte strings are equal, comparing every byte whatever the first difference.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let diff = a
        .iter()
        .zip(b)
        .fold((a.len() != b.len()) as u8, |acc, (x, y)| acc | (x ^ y));
    std::hint::black_box(diff) == 0
}

/// Why an exchange failed; the text is the AUTH_ERROR reply's message. A wrong password, an
/// unknown user and a user without keys for the mechanism are one and the same `Failed`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScramError {
    #[error("SCRAM client-first message: {0}")]
    ClientFirst(&'static str),
    #[error("SCRAM client-final message: {0}")]
    ClientFinal(&'static str),
    #[error("SCRAM client-final message: the nonce is not this exchange's")]
    Nonce,
    #[error("SCRAM: the server has no source of random numbers")]
    Random,
    #[error("Auth failure")]
    Failed,
}

/// The parts of a client-first message: `GS2_HEADER n=USER,r=CLIENT_NONCE[,extensions]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientFirst {
    /// The user name, `=2C` and `=3D` decoded.
    pub user: String,
    /// `n,,` (or `y,,`, `n,a=USER,`): what the client-final's `c=` must repeat.
    gs2_header: String,
    /// The message without its GS2 header, part of the AuthMessage.
    bare: String,
    client_nonce: String,
}

/// A SCRAM `saslname`: `=2C` is `,` and `=3D` is `=`; any other `=` is malformed.
fn decode_name(s: &str) -> Option<String> {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(at) = rest.find('=') {
        out.push_str(&rest[..at]);
        match rest.get(at..at + 3) {
            Some("=2C") => out.push(','),
            Some("=3D") => out.push('='),
            _ => return None,
        }
        rest = &rest[at + 3..];
    }
    out.push_str(rest);
    Some(out)
}

/// A nonce's characters: printable ASCII but the comma. RFC 5802 leaves out the space too;
/// Couchbase's clients have sent nonces with spaces, so the space is taken.
fn valid_nonce(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(|b| (0x20..=0x7e).contains(&b) && b != b',')
}

pub fn parse_client_first(message: &[u8]) -> Result<ClientFirst, ScramError> {
    use ScramError::ClientFirst as Bad;
    let message = std::str::from_utf8(message).map_err(|_| Bad("not UTF-8"))?;
    let mut parts = message.splitn(3, ',');
    let (Some(cbind), Some(authzid), Some(bare)) = (parts.next(), parts.next(), parts.next())
    else {
        return Err(Bad("expected n,,n=USER,r=NONCE"));
    };
    match cbind {
        "n" | "y" => {}
        p if p.starts_with("p=") => return Err(Bad("channel binding is not supported")),
        _ => return Err(Bad("the GS2 header starts with n, y or p=")),
    }
    let mut attributes = bare.split(',');
    let user = match attributes.next() {
        Some(m) if m.starts_with("m=") => {
            return Err(Bad("mandatory extension (m=) not supported"))
        }
        Some(n) => n
            .strip_prefix("n=")
            .ok_or(Bad("the user (n=) comes first"))?,
        None => return Err(Bad("no user (n=)")),
    };
    let user = decode_name(user).ok_or(Bad("a user name's = is =2C or =3D"))?;
    if !authzid.is_empty() {
        let authzid = authzid
            .strip_prefix("a=")
            .and_then(decode_name)
            .ok_or(Bad("the authorization identity is a=NAME"))?;
        if authzid != user {
            return Err(Bad("acting as another user (a=) is not supported"));
        }
    }
    let client_nonce = attributes
        .next()
        .and_then(|r| r.strip_prefix("r="))
        .ok_or(Bad("the nonce (r=) follows the user"))?;
    if !valid_nonce(client_nonce) {
        return Err(Bad("the nonce (r=) is printable ASCII without commas"));
    }
    Ok(ClientFirst {
        user,
        gs2_header: message[..cbind.len() + authzid.len() + 2].to_string(),
        bare: bare.to_string(),
        client_nonce: client_nonce.to_string(),
    })
}

/// The secret that fake salts are derived with: drawn once per process.
static FAKE_SALT_SECRET: LazyLock<Option<[u8; 32]>> = LazyLock::new(|| {
    let mut secret = [0u8; 32];
    getrandom::fill(&mut secret).ok().map(|_| secret)
});

/// The keys an exchange for a user without keys runs with: a salt derived from the name (the
/// same for every look in this process), `iterations`, keys nothing matches.
pub fn fake_keys(mechanism: Mechanism, user: &str, iterations: u32) -> Result<Keys, ScramError> {
    let secret = FAKE_SALT_SECRET.as_ref().ok_or(ScramError::Random)?;
    let mut input = mechanism.scheme().as_bytes().to_vec();
    input.push(0);
    input.extend_from_slice(user.as_bytes());
    let salt = Mechanism::Sha256.hmac(secret, &input)[..16].to_vec();
    Ok(Keys {
        mechanism,
        iterations,
        salt,
        stored_key: vec![0; mechanism.key_len()],
        server_key: vec![0; mechanism.key_len()],
    })
}

/// An exchange between the server-first message and the client-final one.
#[derive(Debug)]
pub struct Exchange {
    first: ClientFirst,
    server_first: String,
    keys: Keys,
    /// Whether `keys` are the user's (else they are fake and the exchange fails).
    known: bool,
}

impl Exchange {
    /// Starts an exchange: the server-first message to send back. `keys` are the user's for
    /// this mechanism, or fake ones (`fake_keys`) with `known` false.
    pub fn start(
        first: ClientFirst,
        keys: Keys,
        known: bool,
    ) -> Result<(Exchange, String), ScramError> {
        let mut random = [0u8; 18];
        getrandom::fill(&mut random).map_err(|_| ScramError::Random)?;
        Ok(Exchange::start_with_nonce(
            first,
            keys,
            known,
            &base64::encode(&random),
        ))
    }

    fn start_with_nonce(
        first: ClientFirst,
        keys: Keys,
        known: bool,
        server_nonce: &str,
    ) -> (Exchange, String) {
        let server_first = format!(
            "r={}{server_nonce},s={},i={}",
            first.client_nonce,
            base64::encode(&keys.salt),
            keys.iterations
        );
        let exchange = Exchange {
            first,
            server_first: server_first.clone(),
            keys,
            known,
        };
        (exchange, server_first)
    }

    pub fn user(&self) -> &str {
        &self.first.user
    }

    pub fn mechanism(&self) -> Mechanism {
        self.keys.mechanism
    }

    /// Checks the client-final message `c=GS2_HEADER_B64,r=NONCE[,extensions],p=PROOF` and
    /// returns the server-final message `v=SERVER_SIGNATURE`.
    pub fn finish(self, message: &[u8]) -> Result<String, ScramError> {
        use ScramError::ClientFinal as Bad;
        let message = std::str::from_utf8(message).map_err(|_| Bad("not UTF-8"))?;
        let at = message
            .rfind(",p=")
            .ok_or(Bad("no proof (p=) at the end"))?;
        let (without_proof, proof) = (&message[..at], &message[at + 3..]);
        let mut attributes = without_proof.split(',');
        let binding = attributes
            .next()
            .and_then(|c| c.strip_prefix("c="))
            .ok_or(Bad("the channel binding (c=) comes first"))?;
        if binding != base64::encode(self.first.gs2_header.as_bytes()) {
            return Err(Bad("c= is not the client-first message's GS2 header"));
        }
        let nonce = attributes
            .next()
            .and_then(|r| r.strip_prefix("r="))
            .ok_or(Bad("the nonce (r=) follows c="))?;
        let expected_nonce = self.server_first["r=".len()..]
            .split(',')
            .next()
            .unwrap_or_default();
        if nonce != expected_nonce {
            return Err(ScramError::Nonce);
        }
        let proof = base64::decode(proof.as_bytes()).ok_or(Bad("the proof (p=) is not base64"))?;
        let mechanism = self.keys.mechanism;
        if proof.len() != mechanism.key_len() {
            return Err(Bad("the proof's length is not the mechanism's hash length"));
        }
        let auth_message = format!("{},{},{without_proof}", self.first.bare, self.server_first);
        // ClientKey := ClientProof XOR HMAC(StoredKey, AuthMessage); the proof holds when
        // H(ClientKey) is StoredKey.
        let signature = mechanism.hmac(&self.keys.stored_key, auth_message.as_bytes());
        let client_key: Vec<u8> = proof.iter().zip(&signature).map(|(p, s)| p ^ s).collect();
        let matches = constant_time_eq(&mechanism.hash(&client_key), &self.keys.stored_key);
        if !(matches && self.known) {
            return Err(ScramError::Failed);
        }
        let server_signature = mechanism.hmac(&self.keys.server_key, auth_message.as_bytes());
        Ok(format!("v={}", base64::encode(&server_signature)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs an exchange with a chosen server nonce: the server-first message and the answer to
    /// the client-final one.
    fn exchange(
        keys: &Keys,
        client_first: &str,
        server_nonce: &str,
        client_final: &str,
    ) -> (String, Result<String, ScramError>) {
        let first = parse_client_first(client_first.as_bytes()).unwrap();
        let (ex, server_first) =
            Exchange::start_with_nonce(first, keys.clone(), true, server_nonce);
        (server_first, ex.finish(client_final.as_bytes()))
    }

    #[test]
    fn rfc5802_sha1_test_vector() {
        // RFC 5802 section 5: user "user", password "pencil".
        let salt = base64::decode(b"QSXCR+Q6sek8bf92").unwrap();
        let keys = Keys::derive(Mechanism::Sha1, b"pencil", &salt, 4096);
        let (server_first, server_final) = exchange(
            &keys,
            "n,,n=user,r=fyko+d2lbbFgONRv9qkxdawL",
            "3rfcNHYJY1ZVvWVs7j",
            "c=biws,r=fyko+d2lbbFgONRv9qkxdawL3rfcNHYJY1ZVvWVs7j,p=v0X8v3Bz2T0CJGbJQyF0X+HI4Ts=",
        );
        assert_eq!(
            server_first,
            "r=fyko+d2lbbFgONRv9qkxdawL3rfcNHYJY1ZVvWVs7j,s=QSXCR+Q6sek8bf92,i=4096"
        );
        assert_eq!(server_final.unwrap(), "v=rmF9pqV8S7suAoZWja4dJRkFsKQ=");
    }

    #[test]
    fn rfc7677_sha256_test_vector() {
        // RFC 7677 section 3: user "user", password "pencil".
        let salt = base64::decode(b"W22ZaJ0SNY7soEsUEjb6gQ==").unwrap();
        let keys = Keys::derive(Mechanism::Sha256, b"pencil", &salt, 4096);
        let (server_first, server_final) = exchange(
            &keys,
            "n,,n=user,r=rOprNGfwEbeRWgbNEkqO",
            "%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0",
            "c=biws,r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,\
             p=dHzbZapWIk4jUhN+Ute9ytag9zjfMHgsqmmiz7AndVQ=",
        );
        assert_eq!(
            server_first,
            "r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,s=W22ZaJ0SNY7soEsUEjb6gQ==,i=4096"
        );
        assert_eq!(
            server_final.unwrap(),
            "v=6rriTRBi23WpRR/wtup+mMhUZUn/dB5nLTJRsjl95G4="
        );
    }

    /// A client's side of SCRAM, from the RFC's formulas: the client-final message and the
    /// server signature it expects.
    fn client_final(
        mechanism: Mechanism,
        password: &[u8],
        client_first_bare: &str,
        server_first: &str,
    ) -> (String, String) {
        let attr = |k: &str| {
            server_first
                .split(',')
                .find_map(|a| a.strip_prefix(k))
                .unwrap()
                .to_string()
        };
        let salt = base64::decode(attr("s=").as_bytes()).unwrap();
        let salted = mechanism.salted_password(password, &salt, attr("i=").parse().unwrap());
        let client_key = mechanism.hmac(&salted, b"Client Key");
        let without_proof = format!("c=biws,r={}", attr("r="));
        let auth = format!("{client_first_bare},{server_first},{without_proof}");
        let signature = mechanism.hmac(&mechanism.hash(&client_key), auth.as_bytes());
        let proof: Vec<u8> = client_key
            .iter()
            .zip(&signature)
            .map(|(a, b)| a ^ b)
            .collect();
        let server_key = mechanism.hmac(&salted, b"Server Key");
        let expected = base64::encode(&mechanism.hmac(&server_key, auth.as_bytes()));
        (
            format!("{without_proof},p={}", base64::encode(&proof)),
            format!("v={expected}"),
        )
    }

    #[test]
    fn sha512_round_trip_with_spaces_in_the_nonce_and_escaped_names() {
        let keys = Keys::derive(Mechanism::Sha512, b"s3cret", b"0123456789abcdef", 1000);
        let first = parse_client_first(b"n,,n=a=2Cb=3Dc,r=nonce with spaces").unwrap();
        assert_eq!(first.user, "a,b=c");
        let (ex, server_first) = Exchange::start(first, keys.clone(), true).unwrap();
        assert!(
            server_first.starts_with("r=nonce with spaces"),
            "{server_first}"
        );
        let (message, expected) = client_final(
            Mechanism::Sha512,
            b"s3cret",
            "n=a=2Cb=3Dc,r=nonce with spaces",
            &server_first,
        );
        assert_eq!(ex.finish(message.as_bytes()).unwrap(), expected);

        // The same exchange with the wrong password, or fake keys, fails the same way.
        let first = parse_client_first(b"n,,n=ada,r=abc").unwrap();
        let (ex, server_first) = Exchange::start(first, keys.clone(), true).unwrap();
        let (message, _) = client_final(Mechanism::Sha512, b"wrong", "n=ada,r=abc", &server_first);
        assert_eq!(ex.finish(message.as_bytes()), Err(ScramError::Failed));
        let fake = fake_keys(Mechanism::Sha512, "nobody", 1000).unwrap();
        assert_eq!(
            fake.salt,
            fake_keys(Mechanism::Sha512, "nobody", 1000).unwrap().salt
        );
        assert_ne!(
            fake.salt,
            fake_keys(Mechanism::Sha512, "nobody2", 1000).unwrap().salt
        );
        let first = parse_client_first(b"n,,n=nobody,r=abc").unwrap();
        let (ex, server_first) = Exchange::start(first, fake, false).unwrap();
        let (message, _) = client_final(Mechanism::Sha512, b"x", "n=nobody,r=abc", &server_first);
        assert_eq!(ex.finish(message.as_bytes()), Err(ScramError::Failed));
    }

    #[test]
    fn malformed_messages_are_refused_with_a_reason() {
        for (message, why) in [
            (&b"n,,r=abc"[..], "the user (n=) comes first"),
            (b"n,,n=ada", "the nonce (r=) follows the user"),
            (b"n,,n=ada,r=", "printable ASCII"),
            (b"n,,n=a=x,r=abc", "=2C or =3D"),
            (b"p=tls-unique,,n=ada,r=abc", "channel binding"),
            (b"n,a=bob,n=ada,r=abc", "another user"),
            (b"n,,m=ext,n=ada,r=abc", "mandatory extension"),
            (b"n=ada,r=abc", "expected n,,n=USER,r=NONCE"),
            (b"n,,n=ada,r=a\xffb", "not UTF-8"),
            (b"", "expected"),
        ] {
            let err = parse_client_first(message).unwrap_err().to_string();
            assert!(err.contains(why), "{message:?}: {err}");
        }
        let keys = Keys::derive(Mechanism::Sha256, b"pw", b"saltsalt", 1000);
        let start = || {
            let first = parse_client_first(b"n,,n=ada,r=abc").unwrap();
            Exchange::start_with_nonce(first, keys.clone(), true, "XYZ").0
        };
        let proof = base64::encode(&[0; 32]);
        for (message, why) in [
            ("c=biws,r=abcXYZ".to_string(), "no proof"),
            (format!("r=abcXYZ,p={proof}"), "(c=) comes first"),
            (format!("c=eSws,r=abcXYZ,p={proof}"), "GS2 header"),
            (format!("c=biws,p={proof}"), "the nonce (r=) follows c="),
            ("c=biws,r=abcXYZ,p=!!".to_string(), "not base64"),
            ("c=biws,r=abcXYZ,p=AAAA".to_string(), "length"),
            (format!("c=biws,r=abcXYQ,p={proof}"), "not this exchange's"),
            (format!("c=biws,r=abc,p={proof}"), "not this exchange's"),
        ] {
            let err = start().finish(message.as_bytes()).unwrap_err().to_string();
            assert!(err.contains(why), "{message}: {err}");
        }
        assert_eq!(
            start().finish(format!("c=biws,r=abcXYZ,p={proof}").as_bytes()),
            Err(ScramError::Failed)
        );
    }

    #[test]
    fn plain_checks_a_password_against_the_keys() {
        let keys = Keys::derive(Mechanism::Sha512, b"secret", b"0123456789abcdef", 1000);
        assert!(keys.verify_password(b"secret"));
        assert!(!keys.verify_password(b"Secret"));
        assert!(constant_time_eq(b"ab", b"ab"));
        assert!(!constant_time_eq(b"ab", b"abc") && !constant_time_eq(b"ab", b"ac"));
    }
}
