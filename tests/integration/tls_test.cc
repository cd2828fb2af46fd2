// TLS and mutual TLS on karakvd's TCP listener. The test makes a throwaway CA, a server
// certificate for 127.0.0.1/localhost, a client certificate from the same CA and one from another
// CA (the openssl CLI), then checks who gets in, through the SDK and the karakv CLI.
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "karakv/client.h"
#include "tests/integration/daemon.h"

namespace karakv {
namespace {

using ::testing::HasSubstr;
using testing::Daemon;
using testing::free_port;
using testing::start_on_free_port;

std::string run(const std::string& cmd, int* exit_code) { return testing::run_command(cmd, exit_code); }

class TlsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (std::system("openssl version > /dev/null 2>&1") != 0) return;
    dir_ = new std::string("/tmp/karakv-tls-" + std::to_string(getpid()));
    const std::string d = *dir_;
    std::ofstream(d + ".server.ext") << "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n";
    std::ofstream(d + ".client.ext") << "extendedKeyUsage=clientAuth\n";
    const std::string key = " -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes";
    auto ca = [&](const std::string& name) {
      return "openssl req -x509" + key + " -days 1 -subj /CN=" + name + " -keyout " + d + "/" + name + ".key -out " +
             d + "/" + name + ".crt -addext basicConstraints=critical,CA:TRUE -addext keyUsage=keyCertSign,cRLSign";
    };
    auto leaf = [&](const std::string& name, const std::string& cn, const std::string& issuer, const std::string& ext) {
      return "openssl req" + key + " -subj /CN=" + cn + " -keyout " + d + "/" + name + ".key -out " + d + "/" + name +
             ".csr && openssl x509 -req -days 1 -in " + d + "/" + name + ".csr -CA " + d + "/" + issuer + ".crt -CAkey " +
             d + "/" + issuer + ".key -CAcreateserial -out " + d + "/" + name + ".crt -extfile " + d + "." + ext + ".ext";
    };
    const std::string script = "set -e; mkdir -p " + d + "; " + ca("ca") + "; " + ca("other-ca") + "; " +
                               leaf("server", "localhost", "ca", "server") + "; " +
                               leaf("client", "worker", "ca", "client") + "; " +
                               leaf("rogue", "rogue", "other-ca", "client");
    generated_ = std::system(("(" + script + ") > " + d + ".log 2>&1").c_str()) == 0;
  }
  static void TearDownTestSuite() {
    if (dir_ == nullptr) return;
    std::system(("rm -rf " + *dir_ + " " + *dir_ + ".server.ext " + *dir_ + ".client.ext " + *dir_ + ".log").c_str());
    delete dir_;
    dir_ = nullptr;
  }
  void SetUp() override {
    if (dir_ == nullptr) GTEST_SKIP() << "the openssl CLI is not installed (scripts/setup.sh installs it)";
    ASSERT_TRUE(generated_) << "openssl failed; see " << *dir_ << ".log";
    port_ = free_port();
  }

  static std::string file(const std::string& name) { return *dir_ + "/" + name; }

  std::vector<std::string> flags(bool mutual) const {
    std::vector<std::string> f = {"--layers=2", "--q_heads=2", "--kv_heads=1", "--head_dim=32", "--block_size=16",
                                  "--dtype=fp32", "--pool_bytes=4MiB",
                                  "--listen_tcp=127.0.0.1:" + std::to_string(port_),
                                  "--tls_cert=" + file("server.crt"), "--tls_key=" + file("server.key")};
    if (mutual) f.push_back("--tls_client_ca=" + file("ca.crt"));
    return f;
  }

  ClientOptions tcp(const std::string& ca, const std::string& cert = "", const std::string& key = "") const {
    ClientOptions o;
    o.target = "127.0.0.1:" + std::to_string(port_);
    o.staging_bytes = 0;
    o.heartbeat = false;
    o.rpc_timeout = absl::Seconds(10);
    o.tls_ca_file = ca.empty() ? "" : file(ca);
    o.tls_cert_file = cert.empty() ? "" : file(cert);
    o.tls_key_file = key.empty() ? "" : file(key);
    return o;
  }

  std::string cli(const std::string& tls_flags) const {
    return std::string(KARAKV_CLI_PATH) + " --timeout=10 --target=127.0.0.1:" + std::to_string(port_) + " " +
           tls_flags + " health 2>&1";
  }

  static std::string* dir_;
  static bool generated_;
  int port_ = 0;
};

std::string* TlsTest::dir_ = nullptr;
bool TlsTest::generated_ = false;

TEST_F(TlsTest, ServesClientsThatTrustItsCaAndRefusesPlaintext) {
  auto started = start_on_free_port([&](int port) { port_ = port; return flags(false); }, &port_);
  Daemon& d = *started;
  ASSERT_TRUE(d.ready());
  auto trusted = Client::Attach(tcp("ca.crt"));
  ASSERT_TRUE(trusted.ok()) << trusted.status();
  EXPECT_TRUE((*trusted)->Ping().ok());
  auto seq = (*trusted)->CreateSequence();
  EXPECT_TRUE(seq.ok()) << seq.status();

  ClientOptions plain = tcp("");
  auto refused = Client::Attach(plain);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnavailable) << refused.status();
  // A certificate from another CA is not trusted either.
  auto wrong_ca = Client::Attach(tcp("other-ca.crt"));
  EXPECT_EQ(wrong_ca.status().code(), absl::StatusCode::kUnavailable) << wrong_ca.status();

  int code = 0;
  EXPECT_EQ(run(cli("--tls_ca=" + file("ca.crt")), &code), "SERVING\n");
  EXPECT_EQ(code, 0);
  run(cli(""), &code);
  EXPECT_NE(code, 0);
  // The Unix socket stays plaintext.
  EXPECT_TRUE(Client::Attach(d.options(0)).ok());
  EXPECT_EQ(d.stop(), 0);
}

TEST_F(TlsTest, MutualTlsAdmitsOnlyClientCertificatesFromItsCa) {
  auto started = start_on_free_port([&](int port) { port_ = port; return flags(true); }, &port_);
  Daemon& d = *started;
  ASSERT_TRUE(d.ready());
  auto admitted = Client::Attach(tcp("ca.crt", "client.crt", "client.key"));
  ASSERT_TRUE(admitted.ok()) << admitted.status();
  EXPECT_TRUE((*admitted)->Ping().ok());

  auto no_cert = Client::Attach(tcp("ca.crt"));
  EXPECT_EQ(no_cert.status().code(), absl::StatusCode::kUnavailable) << no_cert.status();
  auto rogue = Client::Attach(tcp("ca.crt", "rogue.crt", "rogue.key"));
  EXPECT_EQ(rogue.status().code(), absl::StatusCode::kUnavailable) << rogue.status();
  auto plain = Client::Attach(tcp(""));
  EXPECT_EQ(plain.status().code(), absl::StatusCode::kUnavailable) << plain.status();

  int code = 0;
  EXPECT_EQ(run(cli("--tls_ca=" + file("ca.crt") + " --tls_cert=" + file("client.crt") + " --tls_key=" +
                    file("client.key")),
                &code),
            "SERVING\n");
  EXPECT_EQ(code, 0);
  run(cli("--tls_ca=" + file("ca.crt")), &code);
  EXPECT_NE(code, 0);
  EXPECT_EQ(d.stop(), 0);
}

TEST_F(TlsTest, StartupRefusesIncompleteOrUnreadableTlsSettings) {
  const std::string daemon = std::string(KARAKVD_PATH) + " --socket=/tmp/karakv-tls-refused-" +
                             std::to_string(getpid()) + ".sock --pool_bytes=1MiB";
  const std::string tcp = " --listen_tcp=127.0.0.1:" + std::to_string(port_);
  int code = 0;
  EXPECT_THAT(run(daemon + tcp + " --tls_cert=" + file("server.crt") + " 2>&1", &code),
              HasSubstr("--tls_cert and --tls_key go together: got only --tls_cert="));
  EXPECT_EQ(code, 2);
  EXPECT_THAT(run(daemon + tcp + " --tls_client_ca=" + file("ca.crt") + " 2>&1", &code),
              HasSubstr("needs --tls_cert and --tls_key"));
  EXPECT_EQ(code, 2);
  EXPECT_THAT(run(daemon + tcp + " --tls_cert=" + file("server.crt") + " --tls_key=" + file("missing.key") + " 2>&1",
                  &code),
              HasSubstr("--tls_key=" + file("missing.key") + ": cannot read it (No such file or directory)"));
  EXPECT_EQ(code, 2);
  std::ofstream(file("notes.txt")) << "not a certificate\n";
  EXPECT_THAT(run(daemon + tcp + " --tls_cert=" + file("notes.txt") + " --tls_key=" + file("server.key") + " 2>&1",
                  &code),
              HasSubstr("--tls_cert=" + file("notes.txt") + " does not hold PEM data"));
  EXPECT_EQ(code, 2);
  EXPECT_THAT(run(daemon + " --tls_cert=" + file("server.crt") + " --tls_key=" + file("server.key") + " 2>&1", &code),
              HasSubstr("--listen_tcp is empty; the Unix socket does not use TLS"));
  EXPECT_EQ(code, 2);
}

}  // namespace
}  // namespace karakv
