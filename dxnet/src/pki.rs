//! Development PKI for TLS clusters (Cargo feature `pki-gen`): a CA and
//! one certificate per node id, in the form the TCP transport's TLS
//! expects (see [`crate::TlsConfig`]).

use std::io::Write;
use std::path::Path;

use crate::config::TlsConfig;
use crate::{Error, NodeId, Result};

/// Writes a development PKI for a cluster into `dir`: a new CA (`ca.pem`,
/// `ca.key`) and for
/// each id a certificate naming `node-<id>.dxnet` with its key
/// (`node-<id>.pem`, `node-<id>.key`). Returns the [`TlsConfig`] of each id,
/// in order. Keys are written with mode 0600. For production, issue the
/// node certificates from your own CA the same way.
pub fn generate_cluster_pki(dir: &Path, ids: &[NodeId]) -> Result<Vec<TlsConfig>> {
    use rcgen::{
        BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer,
        KeyPair, KeyUsagePurpose,
    };
    let err = |what: &str, e: &dyn std::fmt::Display| Error::Config(format!("{what}: {e}"));
    std::fs::create_dir_all(dir).map_err(|e| err(&dir.display().to_string(), &e))?;
    let write = |name: &str, text: &str, secret: bool| -> Result<String> {
        use std::os::unix::fs::OpenOptionsExt;
        let path = dir.join(name);
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(if secret { 0o600 } else { 0o644 })
            .open(&path)
            .map_err(|e| err(&path.display().to_string(), &e))?;
        f.write_all(text.as_bytes())
            .map_err(|e| err(&path.display().to_string(), &e))?;
        Ok(path.display().to_string())
    };
    let mut params = CertificateParams::new(Vec::new()).map_err(|e| err("CA", &e))?;
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params
        .distinguished_name
        .push(DnType::CommonName, "dxnet cluster CA");
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let key = KeyPair::generate().map_err(|e| err("CA key", &e))?;
    let cert = params.self_signed(&key).map_err(|e| err("CA", &e))?;
    let ca_file = write("ca.pem", &cert.pem(), false)?;
    write("ca.key", &key.serialize_pem(), true)?;
    let issuer = Issuer::new(params, key);
    let mut out = Vec::with_capacity(ids.len());
    for &id in ids {
        let name = TlsConfig::node_name(id);
        let mut params = CertificateParams::new(vec![name.clone()]).map_err(|e| err(&name, &e))?;
        params.distinguished_name.push(DnType::CommonName, &name);
        params.use_authority_key_identifier_extension = true;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let key = KeyPair::generate().map_err(|e| err(&name, &e))?;
        let cert = params
            .signed_by(&key, &issuer)
            .map_err(|e| err(&name, &e))?;
        out.push(TlsConfig {
            cert: write(&format!("node-{}.pem", id.0), &cert.pem(), false)?,
            key: write(&format!("node-{}.key", id.0), &key.serialize_pem(), true)?,
            ca: ca_file.clone(),
        });
    }
    Ok(out)
}
