from fastapi import APIRouter, Request
from fastapi.responses import Response

from pgcarve_api.deps import ReadAuth


class PemResponse(Response):
    media_type = "application/x-pem-file"


router = APIRouter(prefix="/v1", tags=["tls"], dependencies=[ReadAuth])


@router.get("/ca.pem", response_class=PemResponse, responses={200: {
    "description": "The fleet CA certificate, PEM",
    "content": {PemResponse.media_type: {"schema": {"type": "string"}}},
}})
def get_ca_certificate(request: Request) -> PemResponse:
    """The fleet CA's certificate: what clients verify guests' PostgreSQL servers with
    (`sslmode=verify-ca sslrootcert=ca.pem`, or `verify-full`), and the API's own HTTPS off loopback."""
    return PemResponse(request.app.state.fleet_ca.certificate_pem(),
                       headers={"Content-Disposition": 'inline; filename="pgcarve-ca.pem"'})
